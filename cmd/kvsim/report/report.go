// Package report writes kvsim's results: the comparison table in Markdown, the TTFT and ITL
// distributions of each router configuration as PNG plots, and a sweep's trade-off curve.
package report

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

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
// the prefill chunks that stall decoding show.
func CDFs(runs []Run, ttftPath, itlPath string) error {
	ttft := plot.New()
	ttft.Title.Text = "Time to first token"
	ttft.X.Label.Text = "TTFT (s)"
	ttft.Y.Label.Text = "share of requests"
	ttft.X.Scale, ttft.X.Tick.Marker = plot.LogScale{}, plot.LogTicks{}
	itl := plot.New()
	itl.Title.Text = "Inter-token latency: the tail"
	itl.X.Label.Text = "gap between tokens (ms)"
	itl.Y.Label.Text = "share of gaps longer"
	itl.X.Scale, itl.X.Tick.Marker = plot.LogScale{}, plot.LogTicks{}
	itl.Y.Scale, itl.Y.Tick.Marker = plot.LogScale{}, plot.LogTicks{}
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
	line.Color = plotutil.Color(i)
	line.Dashes = plotutil.Dashes(i / len(plotutil.DefaultColors))
	line.Width = vg.Points(1.5)
	p.Add(line)
	p.Legend.Add(name, line)
	p.Legend.Top, p.Legend.Left = false, false
	return nil
}

// SweepPoint is one value of a swept threshold and its replay's summary.
type SweepPoint struct {
	Value   float64
	Summary fleet.Summary
}

// Sweep writes the trade-off curve of a swept threshold as a PNG: TTFT p50 (s), ITL p99.9 (s) and
// the share of requests that miss the goodput bounds, against the threshold (on one axis: all three
// are small numbers); and the points as a Markdown table.
func Sweep(w io.Writer, param string, points []SweepPoint, pngPath string) error {
	fmt.Fprintf(w, "| %s | TTFT p50 | TTFT p99 | ITL p99 | ITL p99.9 | bypass | goodput |\n|---:|---:|---:|---:|---:|---:|---:|\n", param)
	var ttft, itl, missed plotter.XYs
	for _, pt := range points {
		s := pt.Summary
		fmt.Fprintf(w, "| %g | %s | %s | %s | %s | %.1f%% | %.1f%% |\n", pt.Value, secs(s.TTFTP50), secs(s.TTFTP99), millis(s.ITLP99), millis(s.ITLP999), 100*s.Bypass, 100*s.Goodput)
		ttft = append(ttft, plotter.XY{X: pt.Value, Y: s.TTFTP50.Seconds()})
		itl = append(itl, plotter.XY{X: pt.Value, Y: s.ITLP999.Seconds()})
		missed = append(missed, plotter.XY{X: pt.Value, Y: 1 - s.Goodput})
	}
	p := plot.New()
	p.Title.Text = "Conditional disaggregation: " + param
	p.X.Label.Text = param
	p.Y.Label.Text = "seconds, or share of requests"
	if err := plotutil.AddLinePoints(p, "TTFT p50 (s)", ttft, "ITL p99.9 (s)", itl, "requests missing the goodput bounds", missed); err != nil {
		return err
	}
	p.Y.Min = 0
	p.Legend.Top = true
	return p.Save(7*vg.Inch, 4.5*vg.Inch, pngPath)
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
