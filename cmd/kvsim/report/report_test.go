package report

import (
	"bytes"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/cmd/kvsim/fleet"
)

// TestLineStyle: the baselines are told apart from the routed runs by their dashes, not by colour
// alone, and no two runs of a comparison share a colour.
func TestLineStyle(t *testing.T) {
	names := []string{"rr-disagg", "kv-disagg", "cd:isl_bounding", "cd:prefill_load", "cd:isl_or_load", "kv-agg"}
	dashed := map[string]bool{}
	seen := map[any]string{}
	for i, n := range names {
		c, d := lineStyle(n, i)
		if other, ok := seen[c]; ok {
			t.Errorf("%s and %s share a colour", n, other)
		}
		seen[c] = n
		dashed[n] = d != nil
	}
	want := map[string]bool{"rr-disagg": true, "kv-agg": true, "kv-disagg": false, "cd:isl_bounding": false, "cd:prefill_load": false, "cd:isl_or_load": false}
	if diff := cmp.Diff(want, dashed); diff != "" {
		t.Errorf("dashed lines (-want +got):\n%s", diff)
	}
}

func TestDoubling(t *testing.T) {
	pts := func(vs ...float64) []SweepPoint {
		var out []SweepPoint
		for _, v := range vs {
			out = append(out, SweepPoint{Value: v})
		}
		return out
	}
	for _, tc := range []struct {
		name string
		pts  []SweepPoint
		want bool
	}{
		{"eff_isl_threshold doubling", pts(512, 1024, 2048, 4096, 8192, 16384), true},
		{"eff_isl_ratio_threshold", pts(0.5, 0.6, 0.7, 0.8, 0.9, 0.95), false},
		{"a zero", pts(0, 1024, 8192), false},
		{"one point", pts(1024), false},
	} {
		if got := doubling(tc.pts); got != tc.want {
			t.Errorf("%s: doubling = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestPlotsRender draws the comparison's two plots and a sweep of each kind from small replays
// and checks that each is a PNG of the size asked, and the sweep's table has a row per point.
func TestPlotsRender(t *testing.T) {
	dir := t.TempDir()
	var runs []Run
	for i, name := range []string{"rr-disagg", "kv-disagg", "kv-agg"} {
		res := &fleet.Result{}
		for j := range 200 {
			at := time.Duration(j) * time.Millisecond
			res.Records = append(res.Records, fleet.Record{Arrival: at, FirstToken: at + time.Duration(10*(i+1)*(j+1))*time.Millisecond})
			res.ITL = append(res.ITL, float32(8+j%7), float32(1000*(i+1)))
		}
		runs = append(runs, Run{Name: name, Result: res})
	}
	ttft, itl := filepath.Join(dir, "ttft.png"), filepath.Join(dir, "itl.png")
	if err := CDFs(runs, ttft, itl); err != nil {
		t.Fatalf("CDFs() = %v", err)
	}
	for _, sweep := range []struct {
		param  string
		values []float64
	}{{"eff_isl_threshold", []float64{512, 1024, 2048, 4096}}, {"eff_isl_ratio_threshold", []float64{0.5, 0.7, 0.9}}} {
		var points []SweepPoint
		for i, v := range sweep.values {
			points = append(points, SweepPoint{Value: v, Summary: fleet.Summary{TTFTP50: time.Duration(300+i) * time.Millisecond,
				ITLP999: time.Duration(20+100*i) * time.Millisecond, Goodput: 0.8 + 0.01*float64(i)}})
		}
		var table bytes.Buffer
		path := filepath.Join(dir, "sweep-"+sweep.param+".png")
		if err := Sweep(&table, sweep.param, points, path); err != nil {
			t.Fatalf("Sweep(%s) = %v", sweep.param, err)
		}
		if rows := strings.Count(table.String(), "\n"); rows != 2+len(points) {
			t.Errorf("Sweep(%s) table has %d lines, want %d:\n%s", sweep.param, rows, 2+len(points), table.String())
		}
		checkPNG(t, path, 7*96, 7*96)
	}
	checkPNG(t, ttft, 7*96, 4.5*96)
	checkPNG(t, itl, 7*96, 4.5*96)
}

func checkPNG(t *testing.T, path string, w, h int) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cfg, err := png.DecodeConfig(f)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	if cfg.Width != w || cfg.Height != h {
		t.Errorf("%s is %dx%d, want %dx%d", path, cfg.Width, cfg.Height, w, h)
	}
}
