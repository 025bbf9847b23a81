// Binary kvsim replays request traces through a simulated fleet of inference engines and the real
// router, on a virtual clock, and reports what each routing configuration does to time to first
// token, inter-token latency, throughput and cache hits.
//
// Usage:
//
//	kvsim compare [flags]   one trace under several router configurations: report.md and CDF plots
//	kvsim sweep [flags]     one conditional-disaggregation threshold over values: the trade-off curve
//	kvsim replicas [flags]  1, 2, 4 and 8 router replicas, sharing a Redis and not: hit ratio and precision
//	kvsim sensitivity [flags] the comparison again with the cost model's least certain constants
//	                        (attention, KV transfer) at half and twice their values
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"

	"github.com/kvrouter/kvrouter/cmd/kvsim/engine"
	"github.com/kvrouter/kvrouter/cmd/kvsim/fleet"
	"github.com/kvrouter/kvrouter/cmd/kvsim/report"
	"github.com/kvrouter/kvrouter/cmd/kvsim/trace"
	"github.com/kvrouter/kvrouter/policy"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

const usage = `kvsim replays traces through a simulated fleet and the real router.

Usage:
  kvsim compare [flags]   one trace under several router configurations (kvsim compare -h)
  kvsim sweep [flags]     one conditional-disaggregation threshold over values (kvsim sweep -h)
  kvsim replicas [flags]  1, 2, 4 and 8 router replicas, sharing a Redis and not (kvsim replicas -h)
  kvsim sensitivity [flags]  the comparison with the attention and KV-transfer constants at 0.5x and 2x
`

// options are the flags both commands share.
type options struct {
	trace      string
	format     string
	limit      int
	timeScale  float64
	prefill    int
	decode     int
	kvBlocks   int
	out        string
	configs    string
	param      string
	values     string
	cdPolicy   string
	isl, ratio float64
	memProfile string
	redisAddr  string
	counts     string
	seed       uint64
	// attentionScale and networkScale multiply the cost model's attention constants (decode per
	// context token, prefill per token pair) and its KV transfer times: the least certain numbers.
	attentionScale, networkScale float64
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || (args[0] != "compare" && args[0] != "sweep" && args[0] != "replicas" && args[0] != "sensitivity") {
		fmt.Fprint(stderr, usage)
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help") {
			return 0
		}
		return 2
	}
	cmd := args[0]
	var o options
	fs := flag.NewFlagSet("kvsim "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.trace, "trace", "mooncake", "requests: mooncake, azure-code, azure-conv, shared-prefix, multi-turn, or the path of a trace file (--trace-format)")
	fs.StringVar(&o.format, "trace-format", "", "the format of a --trace file: mooncake (JSON lines: timestamp, input_length, output_length, hash_ids) or azure (CSV: TIMESTAMP,ContextTokens,GeneratedTokens); empty: by its extension, .jsonl mooncake, .csv azure")
	fs.IntVar(&o.limit, "limit", 0, "replay only the first N requests (0: all)")
	fs.Uint64Var(&o.seed, "seed", 1, "seeds the router's tie-breaks (equal costs): the same command and seed give the same figures")
	fs.Float64Var(&o.timeScale, "time-scale", 1, "divide arrival times by this: 2 replays the trace twice as fast")
	fs.IntVar(&o.prefill, "prefill", 4, "prefill workers (the aggregated configuration gets prefill + decode aggregated workers)")
	fs.IntVar(&o.decode, "decode", 4, "decode workers")
	fs.IntVar(&o.kvBlocks, "kv-blocks", 0, "override each worker's cache size in blocks (0: the cost model's)")
	fs.StringVar(&o.out, "out", ".tmp/kvsim", "folder for report.md and the plots")
	fs.StringVar(&o.cdPolicy, "cd-policy", "isl_bounding", "sweep: the conditional-disaggregation policy")
	fs.Float64Var(&o.isl, "eff-isl-threshold", 2048, "conditional disaggregation's eff_isl_threshold (Dynamo's default 2048)")
	fs.Float64Var(&o.ratio, "eff-isl-ratio-threshold", 0.7, "conditional disaggregation's eff_isl_ratio_threshold (Dynamo's default 0.7)")
	fs.StringVar(&o.memProfile, "memprofile", "", "write a heap profile here after the replays (go tool pprof)")
	fs.Float64Var(&o.attentionScale, "attention-scale", 1, "multiply the cost model's attention constants (decode per context token, prefill per token pair) by this")
	fs.Float64Var(&o.networkScale, "network-scale", 1, "multiply the cost model's KV transfer times (setup and per block) by this")
	switch cmd {
	case "replicas":
		fs.StringVar(&o.redisAddr, "redis-addr", "", "the Redis the shared replicas use (host:port; required)")
		fs.StringVar(&o.counts, "counts", "1,2,4,8", "replica counts, comma-separated")
		fs.StringVar(&o.configs, "configs", "kv-disagg", "the router configuration")
	case "compare":
		fs.StringVar(&o.configs, "configs", "rr-disagg,kv-disagg,cd:isl_bounding,cd:prefill_load,cd:isl_or_load,kv-agg",
			"router configurations, comma-separated: rr-disagg, kv-disagg, kv-agg, cd:<policy>, or cd:<policy>:<eff_isl_threshold>:<eff_isl_ratio_threshold>")
	case "sensitivity":
		fs.StringVar(&o.configs, "configs", "rr-disagg,kv-disagg,cd:isl_bounding,cd:isl_bounding:8192:0.9,cd:isl_or_load,kv-agg",
			"router configurations, comma-separated, as for compare")
	default:
		fs.StringVar(&o.param, "param", "eff_isl_threshold", "the threshold swept: eff_isl_threshold or eff_isl_ratio_threshold")
		fs.StringVar(&o.values, "values", "256,512,1024,2048,4096,8192,16384", "its values, comma-separated")
	}
	if err := fs.Parse(args[1:]); err != nil {
		return 2
	}
	if err := execute(ctx, cmd, &o, stdout, stderr); err != nil {
		fmt.Fprintf(stderr, "kvsim: %v\n", err)
		return 1
	}
	if o.memProfile != "" {
		if err := writeHeapProfile(o.memProfile); err != nil {
			fmt.Fprintf(stderr, "kvsim: --memprofile: %v\n", err)
			return 1
		}
	}
	return 0
}

// builtinTraces are the public traces kvsim knows by name, by file name (trace.Find looks for them)
// and format.
var builtinTraces = map[string]struct{ file, format string }{
	"mooncake":   {"mooncake_conversation_trace.jsonl", "mooncake"},
	"azure-code": {"azure_llm_2023_code.csv", "azure"},
	"azure-conv": {"azure_llm_2023_conv.csv", "azure"},
}

// loadTrace returns the requests of a built-in trace or generator, or of the trace file at the path
// name in format (empty: by the file's extension).
func loadTrace(name, format string, limit int) ([]trace.Request, error) {
	var reqs []trace.Request
	switch b, builtin := builtinTraces[name]; {
	case name == "shared-prefix":
		reqs = trace.SharedPrefix(64, 16, 2048, 128, 256, 4, 1) // SGLang's generated-shared-prefix 64x16, 2048/128/256
	case name == "multi-turn":
		reqs = trace.MultiTurn(32, 10, 1000, 100, 200, 4, 1)
	case builtin && format != "":
		return nil, fmt.Errorf("--trace-format %s: applies to a trace file given by path, not to the built-in trace %s", format, name)
	case builtin:
		path, err := trace.Find(b.file)
		if err != nil {
			return nil, err
		}
		if reqs, err = loadTraceFile(path, b.format); err != nil {
			return nil, err
		}
	case strings.ContainsRune(name, os.PathSeparator) || strings.HasSuffix(name, ".jsonl") || strings.HasSuffix(name, ".csv"):
		if format == "" {
			switch filepath.Ext(name) {
			case ".jsonl":
				format = "mooncake"
			case ".csv":
				format = "azure"
			default:
				return nil, fmt.Errorf("--trace %s: say its format with --trace-format mooncake or azure (its extension is neither .jsonl nor .csv)", name)
			}
		}
		var err error
		if reqs, err = loadTraceFile(name, format); err != nil {
			return nil, fmt.Errorf("--trace %s: %w", name, err)
		}
	default:
		return nil, fmt.Errorf("--trace %q: want mooncake, azure-code, azure-conv, shared-prefix, multi-turn or the path of a trace file", name)
	}
	if limit > 0 && limit < len(reqs) {
		reqs = reqs[:limit]
	}
	return reqs, nil
}

// loadTraceFile reads the trace file at path in format (mooncake or azure).
func loadTraceFile(path, format string) ([]trace.Request, error) {
	if format != "mooncake" && format != "azure" {
		return nil, fmt.Errorf("--trace-format %q: want mooncake or azure", format)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if format == "mooncake" {
		return trace.LoadMooncake(f, 16)
	}
	return trace.LoadAzure(f)
}

// fleetConfig returns the fleet of a named router configuration.
func fleetConfig(name string, o *options, model engine.CostModel) (fleet.Config, error) {
	cfg := fleet.Config{Model: model, TimeScale: o.timeScale, Prefill: o.prefill, Decode: o.decode, Routing: policy.DefaultConfig(), Seed: o.seed}
	switch {
	case name == "rr-disagg":
		cfg.RoundRobin = true
	case name == "kv-disagg":
	case name == "kv-agg":
		cfg.Prefill, cfg.Decode, cfg.Aggregated = 0, 0, o.prefill+o.decode
	case strings.HasPrefix(name, "cd:"):
		parts := strings.Split(strings.TrimPrefix(name, "cd:"), ":")
		isl, ratio := o.isl, o.ratio
		if len(parts) == 3 { // cd:<policy>:<eff_isl_threshold>:<eff_isl_ratio_threshold>
			var err1, err2 error
			isl, err1 = strconv.ParseFloat(parts[1], 64)
			ratio, err2 = strconv.ParseFloat(parts[2], 64)
			if err := errors.Join(err1, err2); err != nil || isl < 0 || ratio < 0 {
				return cfg, fmt.Errorf("--configs %s: want cd:<policy>:<eff_isl_threshold>:<eff_isl_ratio_threshold>, numbers >= 0", name)
			}
		} else if len(parts) != 1 {
			return cfg, fmt.Errorf("--configs %s: want cd:<policy> or cd:<policy>:<eff_isl_threshold>:<eff_isl_ratio_threshold>", name)
		}
		p, err := policy.LookupCDPolicy(parts[0])
		if err != nil {
			return cfg, fmt.Errorf("--configs %s: %w", name, err)
		}
		cd := policy.DefaultCDConfig()
		cd.Enabled, cd.Policy, cd.EffISLThreshold, cd.EffISLRatioThreshold = true, p, uint64(isl), ratio
		if p.NeedsPrefillBusy() {
			busy := 1.0 // a prefill worker is busy past one batch of queued prefill tokens
			cd.PrefillBusyThreshold = &busy
		}
		cfg.Routing.ConditionalDisagg = cd
	default:
		return cfg, fmt.Errorf("--configs %q: want rr-disagg, kv-disagg, kv-agg or cd:<policy>", name)
	}
	return cfg, nil
}

func execute(ctx context.Context, cmd string, o *options, stdout, stderr io.Writer) error {
	reqs, err := loadTrace(o.trace, o.format, o.limit)
	if err != nil {
		return err
	}
	if o.attentionScale <= 0 || o.networkScale <= 0 {
		return fmt.Errorf("--attention-scale %g, --network-scale %g: must be > 0", o.attentionScale, o.networkScale)
	}
	model := engine.Llama31_8B_H100().Scaled(o.attentionScale, o.networkScale)
	if o.kvBlocks > 0 {
		model.TotalKVBlocks = o.kvBlocks
	}
	if err := os.MkdirAll(o.out, 0o755); err != nil {
		return err
	}
	stats := trace.Stats(reqs, model.BlockSize)
	replay := func(name string, cfg fleet.Config) (report.Run, error) {
		bar := newBar(stderr, len(reqs), name)
		cfg.Progress = func(done, _ int) { _ = bar.Set(done) }
		start := time.Now()
		res, err := fleet.Run(ctx, cfg, reqs)
		_ = bar.Finish()
		if err != nil {
			return report.Run{}, fmt.Errorf("%s: %w", name, err)
		}
		r := report.Run{Name: name, Result: res, Summary: res.Summarize(), Wall: time.Since(start)}
		fmt.Fprintf(stderr, "%s: %d requests, %v of trace in %v\n", name, len(reqs), res.Span.Round(time.Second), r.Wall.Round(time.Millisecond))
		return r, nil
	}
	switch cmd {
	case "sweep":
		return sweep(o, model, reqs, replay, stdout)
	case "replicas":
		return replicas(o, model, replay, stdout)
	case "sensitivity":
		return sensitivity(o, model, replay, stdout)
	}
	var runs []report.Run
	for _, name := range strings.Split(o.configs, ",") {
		cfg, err := fleetConfig(strings.TrimSpace(name), o, model)
		if err != nil {
			return err
		}
		r, err := replay(strings.TrimSpace(name), cfg)
		if err != nil {
			return err
		}
		runs = append(runs, r)
	}
	f, err := os.Create(filepath.Join(o.out, "report.md"))
	if err != nil {
		return err
	}
	defer f.Close()
	w := io.MultiWriter(f, stdout)
	fmt.Fprintf(w, "Trace %s: %d requests over %v (%.2f req/s at time scale %g), ideal token reuse %.3f.\n",
		o.trace, stats.Requests, stats.Span.Round(time.Second), stats.Rate*o.timeScale, o.timeScale, stats.IdealTokenReuse)
	fmt.Fprintf(w, "Fleet: %d prefill + %d decode workers (aggregated: %d); %s, %d blocks of %d tokens a worker.\n\n",
		o.prefill, o.decode, o.prefill+o.decode, model.Name, model.TotalKVBlocks, model.BlockSize)
	if err := report.Table(w, runs, stats.IdealTokenReuse); err != nil {
		return err
	}
	return report.CDFs(runs, filepath.Join(o.out, "ttft-cdf.png"), filepath.Join(o.out, "itl-cdf.png"))
}

func sweep(o *options, model engine.CostModel, reqs []trace.Request, replay func(string, fleet.Config) (report.Run, error), stdout io.Writer) error {
	var points []report.SweepPoint
	for _, v := range strings.Split(o.values, ",") {
		x, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil {
			return fmt.Errorf("--values %q: %w", v, err)
		}
		so := *o
		switch o.param {
		case "eff_isl_threshold":
			so.isl = x
		case "eff_isl_ratio_threshold":
			so.ratio = x
		default:
			return fmt.Errorf("--param %q: want eff_isl_threshold or eff_isl_ratio_threshold", o.param)
		}
		cfg, err := fleetConfig("cd:"+o.cdPolicy, &so, model)
		if err != nil {
			return err
		}
		r, err := replay(fmt.Sprintf("%s=%g", o.param, x), cfg)
		if err != nil {
			return err
		}
		points = append(points, report.SweepPoint{Value: x, Summary: r.Summary})
	}
	f, err := os.Create(filepath.Join(o.out, "sweep-"+o.param+".md"))
	if err != nil {
		return err
	}
	defer f.Close()
	return report.Sweep(io.MultiWriter(f, stdout), o.param, points, filepath.Join(o.out, "sweep-"+o.param+".png"))
}

// sensitivity replays each configuration with the cost model as given and with its attention
// constants, then its KV transfer times, at half and twice their values, and writes, per metric,
// a table of configurations against those variants: a conclusion drawn from the comparison holds
// when it holds in every column.
func sensitivity(o *options, model engine.CostModel, replay func(string, fleet.Config) (report.Run, error), stdout io.Writer) error {
	variants := []report.Variant{
		{Name: "as given", Model: model},
		{Name: "attention 0.5x", Model: model.Scaled(0.5, 1)}, {Name: "attention 2x", Model: model.Scaled(2, 1)},
		{Name: "network 0.5x", Model: model.Scaled(1, 0.5)}, {Name: "network 2x", Model: model.Scaled(1, 2)},
	}
	var names []string
	for _, name := range strings.Split(o.configs, ",") {
		names = append(names, strings.TrimSpace(name))
	}
	results := make([][]fleet.Summary, len(names))
	for i, name := range names {
		for _, v := range variants {
			cfg, err := fleetConfig(name, o, v.Model)
			if err != nil {
				return err
			}
			r, err := replay(name+" ("+v.Name+")", cfg)
			if err != nil {
				return err
			}
			results[i] = append(results[i], r.Summary)
		}
	}
	f, err := os.Create(filepath.Join(o.out, "sensitivity.md"))
	if err != nil {
		return err
	}
	defer f.Close()
	return report.Sensitivity(io.MultiWriter(f, stdout), names, variants, results)
}

// replicas replays the trace against each replica count, sharing state through Redis and not, and
// writes the hit ratio, routing precision and latency of each.
func replicas(o *options, model engine.CostModel, replay func(string, fleet.Config) (report.Run, error), stdout io.Writer) error {
	if o.redisAddr == "" {
		return errors.New("--redis-addr: the shared replicas need a Redis (redis-server --port 6390 --save '' --appendonly no)")
	}
	cfg, err := fleetConfig(o.configs, o, model)
	if err != nil {
		return err
	}
	var rows []report.ReplicaRow
	for _, c := range strings.Split(o.counts, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(c))
		if err != nil || n < 1 {
			return fmt.Errorf("--counts %q: want positive integers", c)
		}
		for _, shared := range []bool{true, false} {
			if n == 1 && !shared {
				continue // one replica shares with nobody
			}
			rc := cfg
			rc.Replicas = n
			name := fmt.Sprintf("%d not sharing", n)
			if shared {
				rc.RedisAddr, name = o.redisAddr, fmt.Sprintf("%d sharing Redis", n)
			}
			r, err := replay(name, rc)
			if err != nil {
				return err
			}
			rows = append(rows, report.ReplicaRow{Replicas: n, Shared: shared, Summary: r.Summary, Wall: r.Wall})
		}
	}
	f, err := os.Create(filepath.Join(o.out, "replicas.md"))
	if err != nil {
		return err
	}
	defer f.Close()
	return report.Replicas(io.MultiWriter(f, stdout), rows)
}

// writeHeapProfile writes the heap as it is now, after a collection.
func writeHeapProfile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	runtime.GC()
	runtime.GC() // the profile shows the frees of the collection before the last one
	return pprof.WriteHeapProfile(f)
}

// newBar returns a progress bar on stderr when it is a terminal, and a silent one otherwise.
func newBar(stderr io.Writer, total int, name string) *progressbar.ProgressBar {
	if f, ok := stderr.(*os.File); !ok || !term.IsTerminal(int(f.Fd())) {
		return progressbar.DefaultSilent(int64(total))
	}
	return progressbar.NewOptions(total, progressbar.OptionSetWriter(stderr), progressbar.OptionSetDescription(name),
		progressbar.OptionShowCount(), progressbar.OptionSetPredictTime(true), progressbar.OptionClearOnFinish())
}
