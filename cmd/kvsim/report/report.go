// Package report writes kvsim's results: the comparison table in Markdown, the TTFT and ITL
// distributions of each router configuration as PNG plots, and a sweep's trade-off curve.
package report

import (
	"cmp"
	"fmt"
	"image/color"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"

	"github.com/kvrouter/kvrouter/cmd/kvsim/engine"
	"github.com/kvrouter/kvrouter/cmd/kvsim/fleet"
)

// Run is one configuration's replay, named as the report shows it.
type Run struct {
	Name    string
	Result  *fleet.Result
	Summary fleet.Summary
	// Wall is how long the replay took in real time.
	Wall time.Duration
}

// Table writes the comparison table: one row per run. idealReuse is the trace's ideal token reuse
// (one infinite cache), against which the hit ratios are read.
func Table(w io.Writer, runs []Run, idealReuse float64) error {
	var b strings.Builder
	b.WriteString("| configuration | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p99 | ITL p99.9 | E2E p50 | E2E p90 | output tok/s | goodput | hit ratio (of ideal) | bypass | prefill util | decode util |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range runs {
		s := r.Summary
		ofIdeal := "–"
		if idealReuse > 0 {
			ofIdeal = fmt.Sprintf("%.0f%%", 100*s.HitRatio/idealReuse)
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %.0f | %.1f%% | %.3f (%s) | %.1f%% | %.0f%% | %.0f%% |\n",
			r.Name, secs(s.TTFTP50), secs(s.TTFTP90), secs(s.TTFTP99), millis(s.ITLP50), millis(s.ITLP99), millis(s.ITLP999), secs(s.E2EP50), secs(s.E2EP90),
			s.Throughput, 100*s.Goodput, s.HitRatio, ofIdeal, 100*s.Bypass, 100*s.PrefillUtil, 100*s.DecodeUtil)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func secs(d time.Duration) string { return fmt.Sprintf("%.2f s", d.Seconds()) }
func millis(d time.Duration) string {
	return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond))
}

// CDFs writes two PNG plots, one line per run: the distribution of TTFT (seconds, log axis), and
// the tail of ITL (milliseconds): the share of gaps longer than x, both axes logarithmic, where
// the prefill chunks that stall decoding show. Each legend sits in the corner its curves leave
// empty: the TTFT distribution's top left (few requests are that fast), the ITL tail's bottom left
// (every run has short gaps), never over the long tail the plot is for.
func CDFs(runs []Run, ttftPath, itlPath string) error {
	ttft := plot.New()
	ttft.Title.Text = "Time to first token"
	ttft.X.Label.Text = "TTFT (s)"
	ttft.Y.Label.Text = "share of requests"
	ttft.X.Scale, ttft.X.Tick.Marker = plot.LogScale{}, plot.LogTicks{}
	ttft.Legend.Top, ttft.Legend.Left = true, true
	itl := plot.New()
	itl.Title.Text = "Inter-token latency: the tail"
	itl.X.Label.Text = "gap between tokens (ms)"
	itl.Y.Label.Text = "share of gaps longer"
	itl.X.Scale, itl.X.Tick.Marker = plot.LogScale{}, plot.LogTicks{}
	itl.Y.Scale, itl.Y.Tick.Marker = plot.LogScale{}, plot.LogTicks{}
	itl.Legend.Top, itl.Legend.Left = false, true
	for _, p := range []*plot.Plot{ttft, itl} {
		p.Legend.XOffs, p.Legend.YOffs = vg.Millimeter*4, vg.Millimeter*2
		p.Legend.Padding = vg.Millimeter
	}
	if !itl.Legend.Top {
		itl.Legend.YOffs = vg.Millimeter * 4 // above the axis's ticks
	}
	for i, r := range runs {
		vals := make([]float64, 0, len(r.Result.Records))
		for _, rec := range r.Result.Records {
			vals = append(vals, max(rec.TTFT().Seconds(), 1e-3))
		}
		if err := addCDF(ttft, r.Name, i, vals, false); err != nil {
			return err
		}
		gaps := make([]float64, 0, len(r.Result.ITL))
		for _, g := range r.Result.ITL {
			gaps = append(gaps, max(float64(g), 0.1))
		}
		if err := addCDF(itl, r.Name, i, gaps, true); err != nil {
			return err
		}
	}
	if err := ttft.Save(7*vg.Inch, 4.5*vg.Inch, ttftPath); err != nil {
		return err
	}
	return itl.Save(7*vg.Inch, 4.5*vg.Inch, itlPath)
}

// palette is Okabe and Ito's eight colours, told apart also by readers with colour-blindness;
// black is left out (the axes are black) and the yellow is last (faint on white).
var palette = []color.Color{
	color.RGBA{R: 0xe6, G: 0x9f, A: 0xff},          // orange
	color.RGBA{R: 0x56, G: 0xb4, B: 0xe9, A: 0xff}, // sky blue
	color.RGBA{G: 0x9e, B: 0x73, A: 0xff},          // bluish green
	color.RGBA{G: 0x72, B: 0xb2, A: 0xff},          // blue
	color.RGBA{R: 0xd5, G: 0x5e, A: 0xff},          // vermillion
	color.RGBA{R: 0xcc, G: 0x79, B: 0xa7, A: 0xff}, // reddish purple
	color.RGBA{R: 0xf0, G: 0xe4, B: 0x42, A: 0xff}, // yellow
}

// lineStyle returns the colour and dashes of run i named name. The baselines, round robin
// ("rr-...") and aggregated serving ("...-agg"), are dashed and dotted, so that no two kinds of
// run differ by colour alone.
func lineStyle(name string, i int) (color.Color, []vg.Length) {
	c := palette[i%len(palette)]
	switch {
	case strings.HasPrefix(name, "rr-"):
		return c, []vg.Length{vg.Points(6), vg.Points(3)}
	case strings.HasSuffix(name, "-agg"):
		return c, []vg.Length{vg.Points(1.5), vg.Points(2)}
	}
	return c, nil
}

// addCDF adds the empirical distribution of vals as a line: the share at or below x, or with
// tail, the share above x (down to one value in 10^5); thinned to a few hundred points, denser in
// the tail.
func addCDF(p *plot.Plot, name string, i int, vals []float64, tail bool) error {
	if len(vals) == 0 {
		return nil
	}
	slices.Sort(vals)
	n := float64(len(vals))
	var pts plotter.XYs
	for j := 0; j < len(vals); {
		y := float64(j+1) / n
		if tail {
			y = 1 - y
			if y < 1e-5 {
				break
			}
		}
		pts = append(pts, plotter.XY{X: vals[j], Y: y})
		// Steps shrink with what is left above j, so that the tail keeps its shape.
		j += max(1, min(len(vals)/400, (len(vals)-j)/50))
	}
	if !tail {
		pts = append(pts, plotter.XY{X: vals[len(vals)-1], Y: 1})
	}
	line, err := plotter.NewLine(pts)
	if err != nil {
		return err
	}
	line.Color, line.Dashes = lineStyle(name, i)
	line.Width = vg.Points(1.5)
	p.Add(line)
	p.Legend.Add(name, line)
	return nil
}

// SweepPoint is one value of a swept threshold and its replay's summary.
type SweepPoint struct {
	Value   float64
	Summary fleet.Summary
}

// Sweep writes the trade-off curve of a swept threshold as a PNG of three panels over the same
// threshold axis, each metric on an axis of its own unit: TTFT p50 (s), ITL p99.9 (ms) and
// goodput (% of requests within both bounds), the latencies from zero; and the points as a
// Markdown table. Thresholds that grow by doubling (the largest at least 8 times the smallest) are
// drawn on a log axis, so that the points are evenly spaced; ticks mark the swept values.
func Sweep(w io.Writer, param string, points []SweepPoint, pngPath string) error {
	fmt.Fprintf(w, "| %s | TTFT p50 | TTFT p99 | ITL p99 | ITL p99.9 | bypass | goodput |\n|---:|---:|---:|---:|---:|---:|---:|\n", param)
	var ttft, itl, goodput plotter.XYs
	for _, pt := range points {
		s := pt.Summary
		fmt.Fprintf(w, "| %g | %s | %s | %s | %s | %.1f%% | %.1f%% |\n", pt.Value, secs(s.TTFTP50), secs(s.TTFTP99), millis(s.ITLP99), millis(s.ITLP999), 100*s.Bypass, 100*s.Goodput)
		ttft = append(ttft, plotter.XY{X: pt.Value, Y: s.TTFTP50.Seconds()})
		itl = append(itl, plotter.XY{X: pt.Value, Y: float64(s.ITLP999) / float64(time.Millisecond)})
		goodput = append(goodput, plotter.XY{X: pt.Value, Y: 100 * s.Goodput})
	}
	logX := doubling(points)
	panels := []struct {
		label string
		pts   plotter.XYs
	}{{"TTFT p50 (s)", ttft}, {"ITL p99.9 (ms)", itl}, {"goodput (%)", goodput}}
	var ticks plot.ConstantTicks
	for _, pt := range points {
		ticks = append(ticks, plot.Tick{Value: pt.Value, Label: fmt.Sprintf("%g", pt.Value)})
	}
	grid := make([][]*plot.Plot, len(panels))
	for i, pn := range panels {
		p := plot.New()
		if i == 0 {
			p.Title.Text = "Conditional disaggregation: " + param
		}
		if i == len(panels)-1 {
			p.X.Label.Text = param
		}
		p.Y.Label.Text = pn.label
		if i < 2 {
			p.Y.Min = 0 // latencies from zero, so that a few milliseconds do not look like a cliff
		}
		if logX {
			p.X.Scale = plot.LogScale{}
		}
		p.X.Tick.Marker = ticks // at the swept values, as the table writes them
		line, dots, err := plotter.NewLinePoints(pn.pts)
		if err != nil {
			return err
		}
		line.Color, dots.Color = palette[i], palette[i]
		line.Width = vg.Points(1.5)
		p.Add(line, dots, plotter.NewGrid())
		grid[i] = []*plot.Plot{p}
	}
	img := vgimg.New(7*vg.Inch, 7*vg.Inch)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: len(panels), Cols: 1, PadX: vg.Millimeter * 2, PadY: vg.Millimeter * 3,
		PadTop: vg.Millimeter * 2, PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 4}
	canvases := plot.Align(grid, tiles, dc)
	for i := range grid {
		grid[i][0].Draw(canvases[i][0])
	}
	f, err := os.Create(pngPath)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// doubling reports whether a sweep's thresholds span a factor of 8 or more, all positive: values
// that double from one point to the next, which a log axis spaces evenly.
func doubling(points []SweepPoint) bool {
	if len(points) < 2 {
		return false
	}
	lo, hi := slices.MinFunc(points, byValue).Value, slices.MaxFunc(points, byValue).Value
	return lo > 0 && hi >= 8*lo
}

func byValue(a, b SweepPoint) int { return cmp.Compare(a.Value, b.Value) }

// Variant is one cost model a sensitivity run replays with, named as its column.
type Variant struct {
	Name  string
	Model engine.CostModel
}

// Sensitivity writes three Markdown tables, TTFT p50, ITL p99.9 and goodput: a row per
// configuration (names), a column per cost-model variant; results[i][j] is configuration i's
// replay under variant j.
func Sensitivity(w io.Writer, names []string, variants []Variant, results [][]fleet.Summary) error {
	metrics := []struct {
		title string
		cell  func(fleet.Summary) string
	}{
		{"TTFT p50", func(s fleet.Summary) string { return secs(s.TTFTP50) }},
		{"ITL p99.9", func(s fleet.Summary) string { return millis(s.ITLP999) }},
		{"goodput", func(s fleet.Summary) string { return fmt.Sprintf("%.1f%%", 100*s.Goodput) }},
	}
	for k, m := range metrics {
		if k > 0 {
			fmt.Fprintln(w)
		}
		fmt.Fprintf(w, "| %s |", m.title)
		for _, v := range variants {
			fmt.Fprintf(w, " %s |", v.Name)
		}
		fmt.Fprintf(w, "\n|---|%s\n", strings.Repeat("---:|", len(variants)))
		for i, name := range names {
			fmt.Fprintf(w, "| %s |", name)
			for j := range variants {
				fmt.Fprintf(w, " %s |", m.cell(results[i][j]))
			}
			fmt.Fprintln(w)
		}
	}
	return nil
}

// ReplicaRow is one replica count's replay, sharing state or not.
type ReplicaRow struct {
	Replicas int
	Shared   bool
	Summary  fleet.Summary
	Wall     time.Duration
}

// Replicas writes the replica table: hit ratio and routing precision, and what they cost in latency,
// per replica count; the difference to one replica is in points.
func Replicas(w io.Writer, rows []ReplicaRow) error {
	var base *fleet.Summary
	for i := range rows {
		if rows[i].Replicas == 1 {
			base = &rows[i].Summary
		}
	}
	fmt.Fprintf(w, "| replicas | state | hit ratio | vs 1 | routing precision | vs 1 | TTFT p50 | TTFT p99 | goodput | replay time |\n")
	fmt.Fprintf(w, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range rows {
		s := r.Summary
		state := "own (every worker streams to each)"
		if r.Shared {
			state = "shared through Redis"
		}
		dHit, dPrec := "–", "–"
		if base != nil {
			dHit = fmt.Sprintf("%+.1f pt", 100*(s.HitRatio-base.HitRatio))
			dPrec = fmt.Sprintf("%+.1f pt", 100*(s.Precision-base.Precision))
		}
		if _, err := fmt.Fprintf(w, "| %d | %s | %.3f | %s | %.1f%% | %s | %s | %s | %.1f%% | %s |\n", r.Replicas, state, s.HitRatio, dHit,
			100*s.Precision, dPrec, secs(s.TTFTP50), secs(s.TTFTP99), 100*s.Goodput, r.Wall.Round(time.Second)); err != nil {
			return err
		}
	}
	return nil
}
