package main

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// metricKey names one measured quantity: a benchmark's name (without "Benchmark" and without the
// -GOMAXPROCS suffix Go's benchmarks carry) and the unit of one of its values.
type metricKey struct{ name, unit string }

// results holds every value of every benchmark line read, by name and unit, in first-seen order,
// so that the median and range over repeated runs can be taken as scripts/summarize.awk does.
type results struct {
	order []metricKey
	vals  map[metricKey][]float64
	names []string // benchmark names in first-seen order
}

func newResults() *results { return &results{vals: map[metricKey][]float64{}} }

// procsSuffix is the -GOMAXPROCS suffix `go test -bench` appends to a benchmark's name.
var procsSuffix = regexp.MustCompile(`-\d+$`)

// normName returns a benchmark line's name as results keys it: without the "Benchmark" prefix and
// the -GOMAXPROCS suffix, so that runs on machines of any size compare.
func normName(s string) string {
	return procsSuffix.ReplaceAllString(strings.TrimPrefix(s, "Benchmark"), "")
}

// read adds every Go benchmark line of r: "BenchmarkName N value unit value unit ...". Other lines
// (test logs, benchstat's input header) are skipped.
func (res *results) read(r io.Reader) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 4 || !strings.HasPrefix(f[0], "Benchmark") || len(f[0]) == len("Benchmark") {
			continue
		}
		if _, err := strconv.ParseFloat(f[1], 64); err != nil {
			continue
		}
		name := normName(f[0])
		if !slices.Contains(res.names, name) {
			res.names = append(res.names, name)
		}
		for i := 2; i+1 < len(f); i += 2 {
			v, err := strconv.ParseFloat(f[i], 64)
			if err != nil {
				continue
			}
			k := metricKey{name, f[i+1]}
			if _, ok := res.vals[k]; !ok {
				res.order = append(res.order, k)
			}
			res.vals[k] = append(res.vals[k], v)
		}
	}
	return sc.Err()
}

// readFiles reads every file's benchmark lines; a missing file is skipped (a partial run).
func (res *results) readFiles(paths ...string) error {
	for _, p := range paths {
		f, err := os.Open(p)
		if os.IsNotExist(err) {
			continue
		}
		if err != nil {
			return err
		}
		err = res.read(f)
		f.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", p, err)
		}
	}
	return nil
}

// stat is the median and range of one metric over the runs read.
type stat struct {
	med, lo, hi float64
	n           int
}

// get returns the stat of name's values in unit, and whether there were any.
func (res *results) get(name, unit string) (stat, bool) {
	v := res.vals[metricKey{name, unit}]
	if len(v) == 0 {
		return stat{}, false
	}
	s := slices.Clone(v)
	slices.Sort(s)
	m := len(s)
	med := s[m/2]
	if m%2 == 0 {
		med = (s[m/2-1] + s[m/2]) / 2
	}
	return stat{med: med, lo: s[0], hi: s[m-1], n: m}, true
}

// params returns the key=value segments of a benchmark name ("CurveRoute/curve=tokens/tokens=2048"
// gives curve and tokens).
func params(name string) map[string]string {
	out := map[string]string{}
	for _, seg := range strings.Split(name, "/") {
		if k, v, ok := strings.Cut(seg, "="); ok {
			out[k] = v
		}
	}
	return out
}

// num formats a value as summarize.awk does: whole numbers from 100 up, 4 significant digits below.
func num(x float64) string {
	if x >= 100 || x <= -100 {
		return groupThousands(strconv.FormatFloat(x, 'f', 0, 64))
	}
	return strconv.FormatFloat(x, 'g', 4, 64)
}

// groupThousands puts commas between groups of three digits of an integer's decimal form.
func groupThousands(s string) string {
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

// rangeText formats a stat scaled by scale as "median [min – max]" (just the median for one run).
func (s stat) rangeText(scale float64) string {
	if s.n <= 1 || s.lo == s.hi {
		return num(s.med * scale)
	}
	return fmt.Sprintf("%s [%s – %s]", num(s.med*scale), num(s.lo*scale), num(s.hi*scale))
}
