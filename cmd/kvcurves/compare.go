package main

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
)

// baselineEntry is one headline metric of the baseline file: a benchmark name and unit as
// results keys them, the committed figure (absent when none is committed yet), which direction is
// better, and where the figure comes from.
type baselineEntry struct {
	name, unit string
	value      float64
	has        bool
	lower      bool // lower is better (latencies, bytes); otherwise higher is (throughputs)
	source     string
	line       int // index in the file's lines, to rewrite it
}

// baseline is the parsed baseline file with its lines, so that an update keeps its comments.
type baseline struct {
	lines   []string
	entries []baselineEntry
}

// parseBaseline reads the baseline format: "#" comments and blank lines, and lines of
// "name unit value better source...", where value is a number or "-" (no committed figure yet),
// better is "lower" or "higher", and the source is free text to the end of the line.
func parseBaseline(text string) (*baseline, error) {
	b := &baseline{lines: strings.Split(strings.TrimRight(text, "\n"), "\n")}
	for i, l := range b.lines {
		f := strings.Fields(l)
		if len(f) == 0 || strings.HasPrefix(f[0], "#") {
			continue
		}
		if len(f) < 4 {
			return nil, fmt.Errorf("baseline line %d: want name, unit, value, better and a source, got %q", i+1, l)
		}
		e := baselineEntry{name: normName(f[0]), unit: f[1], source: strings.Join(f[4:], " "), line: i}
		if f[2] != "-" {
			v, err := strconv.ParseFloat(f[2], 64)
			if err != nil {
				return nil, fmt.Errorf("baseline line %d: value %q: want a number or -", i+1, f[2])
			}
			e.value, e.has = v, true
		}
		switch f[3] {
		case "lower":
			e.lower = true
		case "higher":
		default:
			return nil, fmt.Errorf("baseline line %d: better is %q, want lower or higher", i+1, f[3])
		}
		b.entries = append(b.entries, e)
	}
	return b, nil
}

// verdict compares a run's median with a committed figure: the ratio run/committed and, when the
// run is worse (or better) than the committed figure by more than threshold (0.2 = 20%), a flag.
func verdict(e baselineEntry, med, threshold float64) (ratio float64, flag string) {
	if !e.has || e.value == 0 {
		return 0, ""
	}
	ratio = med / e.value
	worse := ratio - 1 // how much worse, as a fraction of the committed figure
	if !e.lower {
		worse = 1 - ratio
	}
	switch {
	case worse > threshold:
		flag = "REGRESSION"
	case worse < -threshold:
		flag = "better"
	}
	return ratio, flag
}

// compare prints every baseline metric: the run's median [min – max], the committed figure, their
// ratio and the flag. It returns how many metrics regressed.
func (b *baseline) compare(w io.Writer, res *results, threshold float64) (int, error) {
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', 0)
	fmt.Fprintf(tw, "metric\tunit\tthis run: median [min – max]\tcommitted\tratio\t\n")
	regressions := 0
	for _, e := range b.entries {
		committed := "–"
		if e.has {
			committed = num(e.value)
		}
		s, ok := res.get(e.name, e.unit)
		if !ok {
			fmt.Fprintf(tw, "%s\t%s\tnot measured\t%s\t\t\n", e.name, e.unit, committed)
			continue
		}
		run := fmt.Sprintf("%s n=%d", s.rangeText(1), s.n)
		ratio, flag := verdict(e, s.med, threshold)
		r := "–"
		if e.has {
			r = fmt.Sprintf("%.2f", ratio)
		}
		if flag == "REGRESSION" {
			regressions++
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", e.name, e.unit, run, committed, r, flag)
	}
	if err := tw.Flush(); err != nil {
		return 0, err
	}
	return regressions, nil
}

// update rewrites the committed figures from the run's medians: every metric the run measured
// (all), or only those without a figure yet (missing). Comments, order and direction are kept; the
// source of a rewritten line names the run.
func (b *baseline) update(res *results, missingOnly bool, run string) string {
	lines := append([]string(nil), b.lines...)
	for _, e := range b.entries {
		s, ok := res.get(e.name, e.unit)
		if !ok || (missingOnly && e.has) {
			continue
		}
		better := "higher"
		if e.lower {
			better = "lower"
		}
		v, _ := strconv.ParseFloat(strconv.FormatFloat(s.med, 'g', 6, 64), 64) // 6 significant digits, written out in full
		lines[e.line] = fmt.Sprintf("%s %s %s %s %s", e.name, e.unit, strconv.FormatFloat(v, 'f', -1, 64), better, run)
	}
	return strings.Join(lines, "\n") + "\n"
}

// runCompare is `kvcurves compare`.
func runCompare(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("compare", stderr, "kvcurves compare -baseline FILE [-threshold 0.2] [-update all|missing] [-run NAME] [-strict] RESULTS...")
	path := fs.String("baseline", "docs/benchmarks/baseline.txt", "baseline file of headline metrics")
	threshold := fs.Float64("threshold", 0.2, "flag a metric worse than its committed figure by more than this fraction")
	update := fs.String("update", "", "rewrite the baseline from this run's medians: all, or missing (only metrics without a figure)")
	run := fs.String("run", "", "name of the run, written as the source of updated figures")
	strict := fs.Bool("strict", false, "exit with status 1 when a metric regressed")
	if code, done := parse(fs, args); done {
		return code
	}
	text, err := os.ReadFile(*path)
	if err != nil {
		fmt.Fprintf(stderr, "kvcurves: %v\n", err)
		return 1
	}
	b, err := parseBaseline(string(text))
	if err != nil {
		fmt.Fprintf(stderr, "kvcurves: %s: %v\n", *path, err)
		return 1
	}
	res := newResults()
	if err := res.readFiles(fs.Args()...); err != nil {
		fmt.Fprintf(stderr, "kvcurves: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "== headline metrics against %s (ratio = this run / committed; REGRESSION: worse by more than %.0f%%)\n", *path, *threshold*100)
	n, err := b.compare(stdout, res, *threshold)
	if err != nil {
		fmt.Fprintf(stderr, "kvcurves: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "%d regression(s)\n", n)
	if *update != "" {
		if *update != "all" && *update != "missing" {
			fmt.Fprintf(stderr, "kvcurves: -update %q: want all or missing\n", *update)
			return 2
		}
		src := "run " + *run
		if *run == "" {
			src = "bench.sh run"
		}
		if err := os.WriteFile(*path, []byte(b.update(res, *update == "missing", src)), 0o644); err != nil {
			fmt.Fprintf(stderr, "kvcurves: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "updated %s (%s) from this run\n", *path, *update)
	}
	if *strict && n > 0 {
		return 1
	}
	return 0
}
