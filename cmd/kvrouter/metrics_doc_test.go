package main

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
)

// The files TestMetricsReference checks.
const (
	metricsDocPath = "../../docs/metrics.md"
	dashboardPath  = "../../deploy/grafana/kvrouter.json"
)

// dashboardMustShow are the families the dashboard must query: what issue 14 asks it to cover
// (routing decisions and conditional disaggregation, Route latency, event ingest, Redis lag and
// degraded mode, snapshot age, load and cache size, refused blocks, security).
var dashboardMustShow = []string{
	"kvrouter_route_decisions_total", "kvrouter_conditional_disagg_gate_total", "grpc_server_handling_seconds",
	"kvrouter_route_decision_seconds", "kvrouter_kv_events_total", "kvrouter_shared_log_apply_lag_seconds",
	"kvrouter_shared_log_degraded", "kvrouter_shared_log_buffered_changes", "kvrouter_shared_log_snapshot_age_seconds",
	"kvrouter_workers", "kvrouter_bookings", "kvrouter_index_blocks", "kvrouter_index_blocks_refused_total",
	"kvrouter_auth_failures_total", "kvrouter_rate_limited_total", "kvrouter_bridge_mirrored_blocks",
}

// TestMetricsReference checks docs/metrics.md and the Grafana dashboard against what the processes
// really export. It starts `kvrouter serve` embedded with conditional disaggregation, `kvrouter
// serve` on a private Redis with TLS and a credentials file, and `kvrouter bridge`, drives the calls
// that create the labelled series (a Route, a Publish, a refused call, a rate-limited one, a
// certificate rotation), and scrapes their /metrics; the bridge's labelled families, which have no
// series before an engine talks, come from the descriptors its package registers. Then:
//   - every exported family has a row (`go_*` and `process_*` rows cover the runtime's families),
//     with its type and labels, and in the Bridge section exactly when only the bridge exports it;
//   - every row names an exported family;
//   - every PromQL expression of the page (the alert column, the promql blocks) and every query of
//     the dashboard names only exported families, with labels they have, and known functions;
//   - the dashboard is a valid Grafana dashboard on the ${datasource} variable that shows what
//     dashboardMustShow lists.
func TestMetricsReference(t *testing.T) {
	doc := readMetricsDoc(t, metricsDocPath)
	exported := exportedMetrics(t, doc)

	t.Run("every exported family is documented", func(t *testing.T) {
		for _, name := range slices.Sorted(maps.Keys(exported)) {
			f := exported[name]
			if doc.lookup(name) == nil {
				t.Errorf("%s (%s, labels %s, exported by %s) has no row in docs/metrics.md", name, f.typ, labelList(f.labels), f.exporters())
			}
		}
	})
	t.Run("every row names an exported family", func(t *testing.T) {
		for _, r := range doc.rows {
			if r.wildcard() {
				if !slices.ContainsFunc(slices.Collect(maps.Keys(exported)), func(n string) bool { return strings.HasPrefix(n, r.prefix()) }) {
					t.Errorf("docs/metrics.md:%d: `%s` matches no exported family", r.line, r.name)
				}
				continue
			}
			if exported[r.name] == nil {
				t.Errorf("docs/metrics.md:%d: `%s` is documented but no process exports it", r.line, r.name)
			}
		}
	})
	t.Run("types, labels and sections", func(t *testing.T) {
		for _, r := range doc.rows {
			if r.wildcard() {
				continue
			}
			f := exported[r.name]
			if f == nil {
				continue
			}
			if r.typ != f.typ {
				t.Errorf("docs/metrics.md:%d: `%s` is a %s, the row says %s", r.line, r.name, f.typ, r.typ)
			}
			if got, want := labelList(f.labels), labelList(setOf(r.labels)); got != want {
				t.Errorf("docs/metrics.md:%d: `%s` has labels %s, the row says %s", r.line, r.name, got, want)
			}
			if bridgeOnly, inBridge := f.bridge && !f.serve, r.section == bridgeSection; bridgeOnly != inBridge {
				t.Errorf("docs/metrics.md:%d: `%s` is exported by %s but documented under %q; the %q section holds exactly the bridge's own families",
					r.line, r.name, f.exporters(), r.section, bridgeSection)
			}
		}
	})
	t.Run("alert expressions", func(t *testing.T) {
		n := 0
		for _, r := range doc.rows {
			for _, expr := range r.alerts {
				n++
				for _, p := range checkPromQL(expr, exported) {
					t.Errorf("docs/metrics.md:%d: `%s`: %s", r.line, expr, p)
				}
			}
		}
		for _, e := range doc.promql {
			n++
			for _, p := range checkPromQL(e.expr, exported) {
				t.Errorf("docs/metrics.md:%d: %s: %s", e.line, e.expr, p)
			}
		}
		if n < 10 {
			t.Errorf("docs/metrics.md has %d PromQL expressions to alert on, want the alerts worth having (at least 10)", n)
		}
	})
	t.Run("dashboard", func(t *testing.T) { checkDashboard(t, dashboardPath, exported) })
}

// family is one metric family as the processes export it.
type family struct {
	typ           string          // counter, gauge, histogram, summary, untyped
	labels        map[string]bool // label names, without le and quantile
	serve, bridge bool            // exported by kvrouter serve, by kvrouter bridge
}

func (f *family) exporters() string {
	switch {
	case f.serve && f.bridge:
		return "serve and bridge"
	case f.bridge:
		return "bridge"
	}
	return "serve"
}

// merge adds from's families to into, marking them as exported by serve or by the bridge.
func merge(into, from map[string]*family, bridge bool) {
	for name, f := range from {
		g := into[name]
		if g == nil {
			g = &family{typ: f.typ, labels: map[string]bool{}}
			into[name] = g
		}
		maps.Copy(g.labels, f.labels)
		if bridge {
			g.bridge = true
		} else {
			g.serve = true
		}
	}
}

// exportedMetrics runs the processes, drives traffic, and returns every family they export. It
// scrapes until the serve processes export every family the page documents outside the Bridge
// section (some appear asynchronously: the snapshot's age, a TLS reload) or 15 s passed; what is
// still missing then fails the comparison.
func exportedMetrics(t *testing.T, doc *metricsDoc) map[string]*family {
	t.Helper()
	bin := buildBinary(t)
	redis := redistest.Start(t)

	// Each process gets its own metrics port: a later --metrics-listen wins over startProcessWith's.
	embeddedMetrics := freePort(t)
	embedded := startProcess(t, bin, "--metrics-listen", embeddedMetrics, "--conditional-disagg")
	driveEmbedded(t, embedded.addr)

	secureMetrics := freePort(t)
	securePicker := freePort(t)
	secure := startSecureRouter(t, "--metrics-listen", secureMetrics, "--redis-addr", redis.Addr, "--snapshot-every", "1", "--picker-listen", securePicker)
	driveSecure(t, secure)
	if _, err := pickOnce(t, secure, securePicker, "frontend", true); err != nil { // the picker's series
		t.Fatalf("a request through the endpoint picker = %v", err)
	}

	bridgeFamilies := bridgeMetrics(t, bin, embedded.addr)

	var want []string
	for _, r := range doc.rows {
		if !r.wildcard() && r.section != bridgeSection {
			want = append(want, r.name)
		}
	}
	var serve map[string]*family
	deadline := time.Now().Add(15 * time.Second)
	for {
		serve = map[string]*family{}
		for _, addr := range []string{embeddedMetrics, secureMetrics} {
			got, err := scrapeMetrics("http://" + addr + "/metrics")
			if err != nil {
				t.Fatalf("scraping kvrouter serve: %v", err)
			}
			merge(serve, got, false)
		}
		if !slices.ContainsFunc(want, func(n string) bool { return serve[n] == nil }) || time.Now().After(deadline) {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	all := map[string]*family{}
	merge(all, serve, false)
	merge(all, bridgeFamilies, true)
	return all
}

// driveEmbedded registers a prefill and a decode worker (the decode one caching two blocks) and
// previews a Route, which conditional disaggregation evaluates: decisions, the gate, KV events.
func driveEmbedded(t *testing.T, addr string) {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), defaultTestTimeout)
	t.Cleanup(cancel)
	hello := func(id uint64, role kvrouterv1.WorkerRole) *kvrouterv1.WorkerHello {
		return &kvrouterv1.WorkerHello{WorkerId: id, Model: "m", Role: role, BlockSize: 4, TotalKvBlocks: 1000,
			MaxNumBatchedTokens: 8192, Endpoint: fmt.Sprintf("w%d", id), SupportsBypass: role == kvrouterv1.WorkerRole_WORKER_ROLE_DECODE,
			KvEventsEnabled: true}
	}
	openStream(ctx, t, conn, hello(1, kvrouterv1.WorkerRole_WORKER_ROLE_PREFILL))
	decode := openStream(ctx, t, conn, hello(2, kvrouterv1.WorkerRole_WORKER_ROLE_DECODE))
	storeBlocks(t, decode, 1, 8)
	router := kvrouterv1.NewRouterServiceClient(conn)
	_, err = router.Route(ctx, &kvrouterv1.RouteRequest{
		Model: "m", TokenIds: []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}, QueryOnly: true})
	if err != nil {
		t.Fatalf("Route = %v", err)
	}
	// A booked request's whole life: its outcomes' histograms.
	if _, err := router.Route(ctx, &kvrouterv1.RouteRequest{RequestId: "metrics-1", Model: "m", TokenIds: []uint32{1, 2, 3, 4, 5}}); err != nil {
		t.Fatalf("Route(booked) = %v", err)
	}
	if _, err := router.MarkPrefillComplete(ctx, &kvrouterv1.MarkPrefillCompleteRequest{RequestId: "metrics-1"}); err != nil {
		t.Fatalf("MarkPrefillComplete = %v", err)
	}
	if _, err := router.Free(ctx, &kvrouterv1.FreeRequest{RequestId: "metrics-1"}); err != nil {
		t.Fatalf("Free = %v", err)
	}
}

// driveSecure makes the calls that create the security series and a snapshot: a call without
// credentials, a worker's events, Route calls over a credential's rate, a certificate rotation.
func driveSecure(t *testing.T, r *secureRouter) {
	t.Helper()
	conn := r.dial(nil)
	route := r.router(conn)
	if err := route(""); err == nil {
		t.Fatal("a Route without credentials was let in")
	}
	ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+r.tokens["worker-7"]), defaultTestTimeout)
	t.Cleanup(cancel)
	stream, err := register(ctx, conn, 7, "llama")
	if err != nil {
		t.Fatalf("registering worker 7 = %v", err)
	}
	storeBlocks(t, stream, 1, 8)
	if err := route("frontend"); err != nil {
		t.Fatalf("Route as frontend = %v", err)
	}
	for i := 0; i < 5 && err == nil; i++ {
		err = route("frontend-slow") // 1 call a second
	}
	if err == nil {
		t.Fatal("frontend-slow was never rate limited")
	}
	r.ca.Server(t).Write(t, r.dir, "server") // reloaded within --file-reload-interval (50 ms)
}

// openStream opens a Publish stream on conn and registers hello; the stream lives until ctx ends.
func openStream(ctx context.Context, t *testing.T, conn *grpc.ClientConn, hello *kvrouterv1.WorkerHello) grpc.BidiStreamingClient[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse] {
	t.Helper()
	stream, err := kvrouterv1.NewWorkerServiceClient(conn).Publish(ctx)
	if err != nil {
		t.Fatalf("Publish = %v", err)
	}
	if err := stream.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Hello{Hello: hello}}); err != nil {
		t.Fatalf("sending the hello = %v", err)
	}
	if resp, err := stream.Recv(); err != nil || resp.GetRegistered() == nil {
		t.Fatalf("registering worker %d = %v, %v", hello.GetWorkerId(), resp, err)
	}
	return stream
}

// storeBlocks publishes event 0 storing blocks of 4 tokens, from..to, and waits for its ack.
func storeBlocks(t *testing.T, stream grpc.BidiStreamingClient[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse], from, to uint32) {
	t.Helper()
	var blocks []*kvrouterv1.StoredBlock
	for tok := from; tok+3 <= to; tok += 4 {
		blocks = append(blocks, &kvrouterv1.StoredBlock{BlockHash: uint64(tok), TokenIds: []uint32{tok, tok + 1, tok + 2, tok + 3}})
	}
	err := stream.Send(&kvrouterv1.PublishRequest{Message: &kvrouterv1.PublishRequest_Events{Events: &kvrouterv1.EventBatch{Events: []*kvrouterv1.KvEvent{{
		EventId: 0, StorageTier: kvrouterv1.StorageTier_STORAGE_TIER_DEVICE,
		Data: &kvrouterv1.KvEvent_Stored{Stored: &kvrouterv1.BlocksStored{Blocks: blocks}}}}}}})
	if err != nil {
		t.Fatalf("publishing = %v", err)
	}
	if resp, err := stream.Recv(); err != nil || resp.GetAck() == nil {
		t.Fatalf("the events' ack = %v, %v", resp, err)
	}
}

// metricsDoc is docs/metrics.md as the test reads it.
type metricsDoc struct {
	rows   []*docRow
	promql []docExpr // the lines of its promql blocks
}

type docExpr struct {
	line int
	expr string
}

// docRow is one row of a metric table.
type docRow struct {
	line          int
	section       string // the ## heading above it
	name          string // a family, or a prefix ending in * for the runtime's families
	typ           string
	labels        []string
	unit, meaning string
	alerts        []string // the PromQL code spans of the alert column
}

func (r *docRow) wildcard() bool { return strings.HasSuffix(r.name, "*") }
func (r *docRow) prefix() string { return strings.TrimSuffix(r.name, "*") }

// lookup returns the row documenting the family name: its own, or a wildcard row's.
func (d *metricsDoc) lookup(name string) *docRow {
	for _, r := range d.rows {
		if r.name == name || (r.wildcard() && strings.HasPrefix(name, r.prefix())) {
			return r
		}
	}
	return nil
}

const (
	metricTableHeader = "| metric | type | labels | unit | meaning | alert on |"
	metricTableRule   = "|---|---|---|---|---|---|"
	bridgeSection     = "Bridge"
)

var (
	rowName      = regexp.MustCompile("^`([a-z_:][a-z0-9_:]*|(go|process)_\\*)`$")
	rowLabel     = regexp.MustCompile("^`([a-z_][a-z0-9_]*)`$")
	codeSpan     = regexp.MustCompile("`([^`]+)`")
	unescapedBar = regexp.MustCompile(`([^\\])\|`)
)

// readMetricsDoc parses the page strictly: a metric table starts with metricTableHeader and
// metricTableRule; each row has six cells: the family in backticks (or go_* / process_*, type
// and labels "various"), its type, its labels in backticks separated by ", " (or "—"), its unit,
// its meaning, and what to alert on, whose code spans are PromQL. A row outside such a table, a
// malformed row, or a family documented twice fails the test.
func readMetricsDoc(t *testing.T, path string) *metricsDoc {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	doc := &metricsDoc{}
	lines := strings.Split(string(data), "\n")
	section, inTable, inPromQL := "", false, false
	seen := map[string]int{}
	for i, line := range lines {
		n := i + 1
		switch {
		case inPromQL:
			if strings.HasPrefix(line, "```") {
				inPromQL = false
				continue
			}
			if expr, _, _ := strings.Cut(line, "#"); strings.TrimSpace(expr) != "" {
				doc.promql = append(doc.promql, docExpr{n, strings.TrimSpace(expr)})
			}
			continue
		case line == "```promql":
			inPromQL = true
			continue
		case strings.HasPrefix(line, "## "):
			section = strings.TrimPrefix(line, "## ")
		case line == metricTableHeader:
			if i+1 >= len(lines) || lines[i+1] != metricTableRule {
				t.Fatalf("%s:%d: a metric table's header must be followed by %q", path, n, metricTableRule)
			}
			inTable = true
			continue
		case inTable && line == metricTableRule:
			continue
		case !strings.HasPrefix(line, "|"):
			inTable = false
		}
		if !strings.HasPrefix(line, "| `") {
			continue
		}
		if !inTable {
			t.Fatalf("%s:%d: a metric row outside a table headed %q", path, n, metricTableHeader)
		}
		r, err := parseDocRow(line)
		if err != nil {
			t.Fatalf("%s:%d: %v", path, n, err)
		}
		r.line, r.section = n, section
		if prev, dup := seen[r.name]; dup {
			t.Fatalf("%s:%d: `%s` is documented twice (first on line %d)", path, n, r.name, prev)
		}
		seen[r.name] = n
		doc.rows = append(doc.rows, r)
	}
	if len(doc.rows) == 0 {
		t.Fatalf("%s has no metric table (header %q)", path, metricTableHeader)
	}
	return doc
}

func parseDocRow(line string) (*docRow, error) {
	if !strings.HasSuffix(line, " |") {
		return nil, fmt.Errorf("a row must end with \" |\": %q", line)
	}
	// A | inside a cell is written \|, as GitHub's tables want, even in code spans.
	body := unescapedBar.ReplaceAllString(strings.TrimSuffix(strings.TrimPrefix(line, "| "), " |"), "$1\x00")
	cells := strings.Split(body, "\x00")
	if len(cells) != 6 {
		return nil, fmt.Errorf("a row has 6 cells (metric, type, labels, unit, meaning, alert on), this one %d", len(cells))
	}
	for i, c := range cells {
		cells[i] = strings.ReplaceAll(strings.TrimSpace(c), `\|`, "|")
		if cells[i] == "" {
			return nil, fmt.Errorf("cell %d is empty", i+1)
		}
	}
	m := rowName.FindStringSubmatch(cells[0])
	if m == nil {
		return nil, fmt.Errorf("the first cell must be one family in backticks, lower case (or go_* / process_*): %q", cells[0])
	}
	r := &docRow{name: m[1], typ: cells[1], unit: cells[3], meaning: cells[4]}
	if r.wildcard() {
		if r.typ != "various" || cells[2] != "various" {
			return nil, fmt.Errorf("`%s` covers several families: its type and labels are \"various\"", r.name)
		}
	} else {
		if !slices.Contains([]string{"counter", "gauge", "histogram", "summary"}, r.typ) {
			return nil, fmt.Errorf("`%s`: type %q, want counter, gauge, histogram or summary", r.name, r.typ)
		}
		if cells[2] != "—" {
			for _, l := range strings.Split(cells[2], ", ") {
				lm := rowLabel.FindStringSubmatch(l)
				if lm == nil {
					return nil, fmt.Errorf("`%s`: labels are names in backticks separated by \", \", or —: %q", r.name, cells[2])
				}
				r.labels = append(r.labels, lm[1])
			}
		}
	}
	for _, span := range codeSpan.FindAllStringSubmatch(cells[5], -1) {
		r.alerts = append(r.alerts, span[1])
	}
	return r, nil
}

// labelList is a set of label names as the page writes it.
func labelList(labels map[string]bool) string {
	if len(labels) == 0 {
		return "—"
	}
	var out []string
	for _, l := range slices.Sorted(maps.Keys(labels)) {
		out = append(out, "`"+l+"`")
	}
	return strings.Join(out, ", ")
}

func setOf(ls []string) map[string]bool {
	s := map[string]bool{}
	for _, l := range ls {
		s[l] = true
	}
	return s
}

// checkDashboard checks the Grafana dashboard: valid JSON, the shape Grafana imports, a Prometheus
// datasource variable every panel uses, and queries that name only exported families.
func checkDashboard(t *testing.T, path string, exported map[string]*family) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		UID           string            `json:"uid"`
		Title         string            `json:"title"`
		SchemaVersion int               `json:"schemaVersion"`
		Panels        []json.RawMessage `json:"panels"`
		Templating    struct {
			List []struct {
				Name  string          `json:"name"`
				Type  string          `json:"type"`
				Query json.RawMessage `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatalf("%s is not valid JSON: %v", path, err)
	}
	if d.UID == "" || d.Title == "" || d.SchemaVersion < 36 || len(d.Panels) == 0 {
		t.Errorf("%s: uid %q, title %q, schemaVersion %d, %d panels: want a uid, a title, schemaVersion >= 36 and panels",
			path, d.UID, d.Title, d.SchemaVersion, len(d.Panels))
	}
	used := map[string]bool{}
	check := func(where, expr string) {
		for _, p := range checkPromQL(expr, exported) {
			t.Errorf("%s: %s: %q", where, p, expr)
		}
		refs, _ := promqlRefs(expr)
		for _, r := range refs {
			used[familyOf(r.name, exported)] = true
		}
	}
	hasDatasource := false
	for _, v := range d.Templating.List {
		switch v.Type {
		case "datasource":
			var q string
			_ = json.Unmarshal(v.Query, &q)
			hasDatasource = hasDatasource || (v.Name == "datasource" && q == "prometheus")
		case "query":
			var q string
			if json.Unmarshal(v.Query, &q) != nil {
				var obj struct {
					Query string `json:"query"`
				}
				_ = json.Unmarshal(v.Query, &obj)
				q = obj.Query
			}
			for _, p := range checkVariableQuery(q, exported) {
				t.Errorf("%s: variable %s: %s", path, v.Name, p)
			}
		}
	}
	if !hasDatasource {
		t.Errorf("%s: no variable named datasource of type datasource querying prometheus", path)
	}
	ids := map[int]string{}
	var walk func(raw []json.RawMessage)
	walk = func(raw []json.RawMessage) {
		for _, pr := range raw {
			var p struct {
				ID         *int                `json:"id"`
				Type       string              `json:"type"`
				Title      string              `json:"title"`
				GridPos    *struct{ H, W int } `json:"gridPos"`
				Datasource *struct {
					UID string `json:"uid"`
				} `json:"datasource"`
				Targets []struct {
					Expr       string `json:"expr"`
					Datasource *struct {
						UID string `json:"uid"`
					} `json:"datasource"`
				} `json:"targets"`
				Panels []json.RawMessage `json:"panels"`
			}
			if err := json.Unmarshal(pr, &p); err != nil {
				t.Errorf("%s: a panel: %v", path, err)
				continue
			}
			where := fmt.Sprintf("%s: panel %q", path, p.Title)
			if p.ID == nil || p.Type == "" || p.Title == "" || p.GridPos == nil || p.GridPos.H == 0 || p.GridPos.W == 0 {
				t.Errorf("%s: every panel has an id, a type, a title and a gridPos", where)
			} else if prev, dup := ids[*p.ID]; dup {
				t.Errorf("%s: id %d is also panel %q's", where, *p.ID, prev)
			} else {
				ids[*p.ID] = p.Title
			}
			walk(p.Panels)
			if p.Type == "row" {
				continue
			}
			if p.Datasource == nil || p.Datasource.UID != "${datasource}" {
				t.Errorf("%s: its datasource must be ${datasource}", where)
			}
			if len(p.Targets) == 0 {
				t.Errorf("%s: no query", where)
			}
			for _, tg := range p.Targets {
				if tg.Datasource != nil && tg.Datasource.UID != "${datasource}" {
					t.Errorf("%s: a query's datasource must be ${datasource}", where)
				}
				if strings.TrimSpace(tg.Expr) == "" {
					t.Errorf("%s: a query without expr", where)
					continue
				}
				check(where, tg.Expr)
			}
		}
	}
	walk(d.Panels)
	for _, name := range dashboardMustShow {
		if !used[name] {
			t.Errorf("%s: no panel queries %s", path, name)
		}
	}
}

var labelValues = regexp.MustCompile(`^label_values\((?:(.+),\s*)?([a-zA-Z_][a-zA-Z0-9_]*)\)$`)

// checkVariableQuery checks a query variable: label_values(selector, label), or PromQL.
func checkVariableQuery(q string, exported map[string]*family) []string {
	m := labelValues.FindStringSubmatch(strings.TrimSpace(q))
	if m == nil {
		return checkPromQL(q, exported)
	}
	if m[1] == "" {
		return []string{fmt.Sprintf("label_values(%s) without a metric", m[2])}
	}
	problems := checkPromQL(m[1], exported)
	refs, _ := promqlRefs(m[1])
	for _, r := range refs {
		if f := exported[familyOf(r.name, exported)]; f != nil && !f.labels[m[2]] && !targetLabels[m[2]] {
			problems = append(problems, fmt.Sprintf("%s has no label %s", r.name, m[2]))
		}
	}
	return problems
}
