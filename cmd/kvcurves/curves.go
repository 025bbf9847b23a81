package main

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
)

// series is one line of a curve: a benchmark metric (unit) of the points' benchmarks whose mode
// segment is mode ("" when the names have none), scaled for display.
type series struct {
	label string
	mode  string
	unit  string
	scale float64
}

// panel is one plot of a curve's figure; a figure holds one or more side by side.
type panel struct {
	title, yLabel string
	series        []series
	linearY       bool // never a log axis (values near zero, or a narrow range)
	guide         bool // draw a line proportional to x through the first series' first point
	// legend is the corner of the legend, where the lines are not: "tl" (top left, the default,
	// for rising lines), "tr", "bl" or "br".
	legend string
}

// column is one column of a curve's table. scale turns the stored value into the shown one and
// may depend on the point's x (per-token or per-worker figures).
type column struct {
	header string
	mode   string
	unit   string
	scale  func(x float64) float64
}

// curve is one scaling curve: the benchmark lines it reads (prefix + xKey=x[/mode=m]), how its x
// is labelled, its figure and its table.
type curve struct {
	id      string // file stem of the PNG and marker of its table in curves.md
	title   string
	prefix  string
	xKey    string
	xLabel  string
	xHeader string
	xText   func(x float64) string
	linearX bool
	panels  []panel
	columns []column
}

func by(f float64) func(float64) float64 { return func(float64) float64 { return f } }

// routeSeries are the four lines of a routing-latency curve, in µs.
var routeSeries = []series{
	{"query-only p50", "query", "p50-ns", 1e-3},
	{"query-only p99", "query", "p99-ns", 1e-3},
	{"booking p50", "book", "p50-ns", 1e-3},
	{"booking p99", "book", "p99-ns", 1e-3},
}

// routeColumns are the latency columns of a routing-latency table, in µs.
var routeColumns = []column{
	{"query p50 (µs)", "query", "p50-ns", by(1e-3)},
	{"query p99 (µs)", "query", "p99-ns", by(1e-3)},
	{"booking p50 (µs)", "book", "p50-ns", by(1e-3)},
	{"booking p99 (µs)", "book", "p99-ns", by(1e-3)},
}

// curves are every curve kvcurves draws, in the order curves.md lists them.
var curves = []curve{
	{
		id: "route-tokens", title: "Route decision latency against prompt length (64 workers, ~1M blocks)",
		prefix: "CurveRoute/curve=tokens/", xKey: "tokens", xLabel: "prompt length (tokens)", xHeader: "prompt tokens", xText: kibi,
		panels: []panel{{title: "Route latency, in process", yLabel: "µs", series: routeSeries, guide: true}},
		columns: append([]column{
			{"deepest cached prefix (blocks)", "query", "walk-blocks", by(1)},
			{"query p50 per block (ns)", "query", "p50-ns", func(x float64) float64 { return 16 / x }},
		}, routeColumns...),
	},
	{
		id: "route-workers", title: "Route decision latency against workers (2,048-token prompts, ~1M blocks)",
		prefix: "CurveRoute/curve=workers/", xKey: "workers", xLabel: "workers", xHeader: "workers", xText: plain,
		panels: []panel{{title: "Route latency, in process", yLabel: "µs", series: routeSeries, guide: true}},
		columns: append([]column{
			{"deepest cached prefix (blocks)", "query", "walk-blocks", by(1)},
			{"query p50 per worker (ns)", "query", "p50-ns", func(x float64) float64 { return 1 / x }},
		}, routeColumns...),
	},
	{
		id: "route-index", title: "Route decision latency against index size (64 workers, 2,048-token prompts)",
		prefix: "CurveRoute/curve=index/", xKey: "blocks", xLabel: "distinct blocks in the index", xHeader: "index blocks (target)", xText: metric,
		panels: []panel{{title: "Route latency, in process", yLabel: "µs", series: routeSeries}},
		columns: append([]column{
			{"index blocks", "query", "index-blocks", by(1)},
			{"deepest cached prefix (blocks)", "query", "walk-blocks", by(1)},
		}, routeColumns...),
	},
	{
		id: "memory-index", title: "Index heap against index size (peers' workload, 64 pods)",
		prefix: "CurveMemory/curve=index/", xKey: "blocks", xLabel: "distinct blocks in the index", xHeader: "index blocks (target)", xText: metric,
		panels: []panel{{title: "Heap per entry", yLabel: "bytes", linearY: true, legend: "br", series: []series{
			{"per (block, worker) entry", "", "B/pair", 1}, {"per distinct block", "", "B/block", 1},
		}}},
		columns: []column{
			{"blocks", "", "blocks", by(1)},
			{"(block, worker) entries", "", "pairs", by(1)},
			{"heap (MB)", "", "heap-MB", by(1)},
			{"bytes per entry", "", "B/pair", by(1)},
			{"bytes per block", "", "B/block", by(1)},
		},
	},
	{
		id: "grpc-concurrency", title: "Route over gRPC against concurrency (kvload, loopback, 64 workers, ~1M blocks, 2,048 tokens, query-only)",
		prefix: "CurveGRPC/curve=concurrency/", xKey: "concurrency", xLabel: "concurrent callers", xHeader: "concurrency", xText: plain,
		panels: []panel{
			{title: "Throughput", yLabel: "requests/s", linearY: true, legend: "br", series: []series{{"requests/s", "query", "req/s", 1}}},
			{title: "Latency", yLabel: "ms", series: []series{{"p50", "query", "p50-ns", 1e-6}, {"p99", "query", "p99-ns", 1e-6}}},
			{title: "CPU per call", yLabel: "µs", linearY: true, legend: "tr", series: []series{
				{"kvrouter", "query", "server-cpu-us/op", 1}, {"kvload", "query", "client-cpu-us/op", 1},
			}},
		},
		columns: []column{
			{"requests/s", "query", "req/s", by(1)},
			{"p50 (ms)", "query", "p50-ns", by(1e-6)},
			{"p99 (ms)", "query", "p99-ns", by(1e-6)},
			{"kvrouter CPU per call (µs)", "query", "server-cpu-us/op", by(1)},
			{"kvload CPU per call (µs)", "query", "client-cpu-us/op", by(1)},
		},
	},
	{
		id: "redis-replicas", title: "Redis mode: ingest and replication lag against replicas (kvload seeding one replica, ~1M blocks)",
		prefix: "CurveRedis/curve=replicas/", xKey: "replicas", xLabel: "replicas", xHeader: "replicas", xText: plain, linearX: true,
		panels: []panel{
			{title: "Ingest", yLabel: "blocks/s", linearY: true, legend: "br", series: []series{
				{"acked (in Redis)", "", "acked-blocks/s", 1}, {"on every replica", "", "replicated-blocks/s", 1},
			}},
			{title: "Lag after the last ack", yLabel: "ms", linearY: true, series: []series{
				{"publishing replica", "", "lag-first-ms", 1}, {"slowest replica", "", "lag-all-ms", 1},
			}},
		},
		columns: []column{
			{"blocks published", "", "published-blocks", by(1)},
			{"acked blocks/s", "", "acked-blocks/s", by(1)},
			{"publishing replica holds all after (ms)", "", "lag-first-ms", by(1)},
			{"every replica holds all after (ms)", "", "lag-all-ms", by(1)},
			{"blocks/s on every replica", "", "replicated-blocks/s", by(1)},
		},
	},
}

// points returns the x values of c found in res, in increasing order.
func (c *curve) points(res *results) []float64 {
	var xs []float64
	for _, name := range res.names {
		if !strings.HasPrefix(name, c.prefix) {
			continue
		}
		x, err := strconv.ParseFloat(params(name)[c.xKey], 64)
		if err == nil && !slices.Contains(xs, x) {
			xs = append(xs, x)
		}
	}
	slices.Sort(xs)
	return xs
}

// name is the benchmark name of c's point x in mode.
func (c *curve) name(x float64, mode string) string {
	n := fmt.Sprintf("%s%s=%s", c.prefix, c.xKey, strconv.FormatFloat(x, 'f', -1, 64))
	if mode != "" {
		n += "/mode=" + mode
	}
	return n
}

// table returns c's Markdown table: one row per point, each cell the median [min – max] over the
// rounds read.
func (c *curve) table(res *results) string {
	var b strings.Builder
	b.WriteString("| " + c.xHeader)
	for _, col := range c.columns {
		b.WriteString(" | " + col.header)
	}
	b.WriteString(" |\n|---:")
	for range c.columns {
		b.WriteString("|---:")
	}
	b.WriteString("|\n")
	for _, x := range c.points(res) {
		b.WriteString("| " + c.xText(x))
		for _, col := range c.columns {
			cell := "–"
			if s, ok := res.get(c.name(x, col.mode), col.unit); ok {
				cell = s.rangeText(col.scale(x))
			}
			b.WriteString(" | " + cell)
		}
		b.WriteString(" |\n")
	}
	return b.String()
}

// plain formats an integer x.
func plain(x float64) string { return groupThousands(strconv.FormatFloat(x, 'f', 0, 64)) }

// kibi formats a token count as 1k, 2k, ... 128k (1k = 1,024).
func kibi(x float64) string {
	if x >= 1024 && math.Mod(x, 1024) == 0 {
		return fmt.Sprintf("%.0fk", x/1024)
	}
	return plain(x)
}

// metric formats a count with k and M suffixes (10k, 1M, 20M).
func metric(x float64) string {
	switch {
	case x >= 1e6 && math.Mod(x, 1e5) == 0:
		return strconv.FormatFloat(x/1e6, 'f', -1, 64) + "M"
	case x >= 1e3 && math.Mod(x, 100) == 0:
		return strconv.FormatFloat(x/1e3, 'f', -1, 64) + "k"
	}
	return plain(x)
}
