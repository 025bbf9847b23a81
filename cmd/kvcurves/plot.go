package main

import (
	"fmt"
	"image/color"
	"math"
	"os"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// decades is the ratio of largest to smallest value from which an axis is logarithmic: a range
// that spans a decade or more is read by its slope, which a log-log plot shows as a straight line.
const decades = 10

// errPoints is a series' points with their [min, max] as error bars around the median.
type errPoints struct {
	plotter.XYs
	low, high []float64
}

func (e errPoints) YError(i int) (float64, float64) { return e.low[i], e.high[i] }

// figure draws c's panels side by side into a PNG at path. It returns false, writing nothing, when
// res holds no point of c.
func (c *curve) figure(res *results, path string) (bool, error) {
	xs := c.points(res)
	if len(xs) == 0 {
		return false, nil
	}
	var plots []*plot.Plot
	for _, pn := range c.panels {
		p, err := c.panelPlot(res, xs, pn)
		if err != nil {
			return false, err
		}
		plots = append(plots, p)
	}
	const panelW, panelH = 5.5 * vg.Inch, 4 * vg.Inch
	img := vgimg.New(panelW*vg.Length(len(plots)), panelH)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 1, Cols: len(plots), PadX: vg.Points(12), PadTop: vg.Points(4), PadBottom: vg.Points(4), PadLeft: vg.Points(4), PadRight: vg.Points(8)}
	canvases := plot.Align([][]*plot.Plot{plots}, tiles, dc)
	for i, p := range plots {
		p.Draw(canvases[0][i])
	}
	f, err := os.Create(path)
	if err != nil {
		return false, err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return false, err
	}
	return true, f.Close()
}

// panelPlot builds one panel: each series as a line through its medians with [min, max] bars.
func (c *curve) panelPlot(res *results, xs []float64, pn panel) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = pn.title
	p.X.Label.Text = c.xLabel
	p.Y.Label.Text = pn.yLabel
	p.Add(plotter.NewGrid())
	ymin, ymax := math.Inf(1), math.Inf(-1)
	var first *plotter.XY
	for i, s := range pn.series {
		var pts errPoints
		for _, x := range xs {
			st, ok := res.get(c.name(x, s.mode), s.unit)
			if !ok {
				continue
			}
			med, lo, hi := st.med*s.scale, st.lo*s.scale, st.hi*s.scale
			pts.XYs = append(pts.XYs, plotter.XY{X: x, Y: med})
			pts.low, pts.high = append(pts.low, med-lo), append(pts.high, hi-med)
			ymin, ymax = math.Min(ymin, lo), math.Max(ymax, hi)
		}
		if len(pts.XYs) == 0 {
			continue
		}
		if first == nil {
			first = &pts.XYs[0]
		}
		line, points, err := plotter.NewLinePoints(pts.XYs)
		if err != nil {
			return nil, err
		}
		line.Color, points.Color = plotutil.Color(i), plotutil.Color(i)
		points.Shape = plotutil.Shape(i)
		line.Width = vg.Points(1.5)
		p.Add(line, points)
		p.Legend.Add(s.label, line, points)
		if len(pts.XYs) > 0 {
			bars, err := plotter.NewYErrorBars(pts)
			if err != nil {
				return nil, err
			}
			bars.Color = plotutil.Color(i)
			p.Add(bars)
		}
	}
	logX := !c.linearX && xs[0] > 0 && xs[len(xs)-1]/xs[0] >= decades
	if logX {
		p.X.Scale = plot.LogScale{}
	}
	var ticks plot.ConstantTicks
	for _, x := range xs {
		ticks = append(ticks, plot.Tick{Value: x, Label: c.xText(x)})
	}
	p.X.Tick.Marker = ticks
	if logX {
		pad := math.Pow(xs[len(xs)-1]/xs[0], 0.03)
		p.X.Min, p.X.Max = xs[0]/pad, xs[len(xs)-1]*pad
	} else {
		pad := (xs[len(xs)-1] - xs[0]) * 0.05
		p.X.Min, p.X.Max = xs[0]-pad, xs[len(xs)-1]+pad
	}
	logY := !pn.linearY && ymin > 0 && ymax/ymin >= decades
	if logY {
		p.Y.Scale, p.Y.Tick.Marker = plot.LogScale{}, logTicks{}
		p.Y.Min, p.Y.Max = ymin/1.15, ymax*1.15
	} else {
		p.Y.Tick.Marker = groupedTicks{}
		if ymin >= 0 {
			p.Y.Min = 0
		}
	}
	if pn.guide && first != nil && logX && logY {
		// A line through the first point with slope 1 on log-log axes: y proportional to x.
		x0, y0 := first.X, first.Y
		guide := plotter.NewFunction(func(x float64) float64 { return y0 * x / x0 })
		guide.XMin, guide.XMax = xs[0], xs[len(xs)-1]
		guide.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
		guide.Color = color.Gray{Y: 140}
		p.Add(guide)
		p.Legend.Add("proportional to x (linear), through the first point", guide)
		p.Y.Max = math.Max(p.Y.Max, y0*xs[len(xs)-1]/x0*1.15)
	}
	p.Legend.Top, p.Legend.Left = pn.legend == "" || pn.legend[0] == 't', pn.legend == "" || pn.legend[1] == 'l'
	p.Legend.TextStyle.Font.Size = vg.Points(9)
	return p, nil
}

// logTicks marks a log axis at 1, 2 and 5 times each power of ten (labelled) and the other
// integers times it (unlabelled), so that a range within one or two decades still reads.
type logTicks struct{}

func (logTicks) Ticks(min, max float64) []plot.Tick {
	var ticks []plot.Tick
	for e := math.Floor(math.Log10(min)); math.Pow(10, e) <= max; e++ {
		base := math.Pow(10, e)
		for m := 1; m < 10; m++ {
			v := float64(m) * base
			if v < min || v > max {
				continue
			}
			t := plot.Tick{Value: v}
			if m == 1 || m == 2 || m == 5 {
				t.Label = trimFloat(v)
			}
			ticks = append(ticks, t)
		}
	}
	return ticks
}

// groupedTicks are gonum's default linear ticks with thousands grouped in their labels
// (12,000 blocks/s, not 12000).
type groupedTicks struct{}

func (groupedTicks) Ticks(min, max float64) []plot.Tick {
	ticks := plot.DefaultTicks{}.Ticks(min, max)
	for i := range ticks {
		if ticks[i].Label != "" && math.Abs(ticks[i].Value) >= 1000 && ticks[i].Value == math.Trunc(ticks[i].Value) {
			ticks[i].Label = groupThousands(fmt.Sprintf("%.0f", ticks[i].Value))
		}
	}
	return ticks
}

// trimFloat formats a tick value without trailing zeros, with thousands grouped.
func trimFloat(v float64) string {
	if v >= 1 {
		return groupThousands(fmt.Sprintf("%.0f", v))
	}
	return fmt.Sprintf("%g", v)
}
