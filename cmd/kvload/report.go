package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// report is the outcome of the measured calls, in the JSON that scripts read (--json) and the text
// kvload prints. CPU per call divides by every measured call, failed ones included; latencies are
// those of the successful calls.
type report struct {
	Mode         string         `json:"mode"` // query_only or booking
	Free         bool           `json:"free,omitempty"`
	Loop         string         `json:"loop"` // closed or open
	Concurrency  int            `json:"concurrency,omitempty"`
	Rate         float64        `json:"rate,omitempty"`
	MaxInflight  int            `json:"max_inflight,omitempty"`
	Conns        int            `json:"conns"`
	Prompts      int            `json:"prompts"`
	RouteTokens  int            `json:"route_tokens"`
	Warmup       int            `json:"warmup"`
	Calls        int            `json:"calls"`
	Errors       map[string]int `json:"errors"`
	FreeErrors   map[string]int `json:"free_errors,omitempty"`
	LateStarts   int            `json:"late_starts"`
	Capped       int            `json:"capped"`
	WallSeconds  float64        `json:"wall_seconds"`
	AchievedRate float64        `json:"achieved_rate"`
	LatencyMs    latency        `json:"latency_ms"`
	ClientCPU    float64        `json:"client_cpu_seconds"`
	ClientCPUUs  float64        `json:"client_cpu_us_per_call"`
	ServerCPU    *float64       `json:"server_cpu_seconds,omitempty"`
	ServerCPUUs  *float64       `json:"server_cpu_us_per_call,omitempty"`
	// ClientCores and ServerCores are the CPU time over the wall time of the measured calls: on a
	// machine whose cores both processes share, how much of it each took.
	ClientCores float64       `json:"client_cores"`
	ServerCores *float64      `json:"server_cores,omitempty"`
	Ingest      *ingestReport `json:"ingest,omitempty"`
	LoadAvg     string        `json:"loadavg"`
}

// latency holds the percentiles of the successful calls' latencies, in milliseconds.
type latency struct {
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
	P999 float64 `json:"p99_9"`
	Max  float64 `json:"max"`
}

func newReport(c *config, p *phase, clientCPU time.Duration) *report {
	r := &report{
		Mode: "query_only", Conns: c.conns, Prompts: c.prompts, RouteTokens: c.routeTokens, Warmup: c.warmup,
		Errors: p.errs, FreeErrors: p.freeErrs, LateStarts: p.late, Capped: p.capped,
		WallSeconds: p.end.Sub(p.start).Seconds(), ClientCPU: clientCPU.Seconds(),
	}
	if !c.queryOnly {
		r.Mode, r.Free = "booking", c.free
	}
	if c.rate > 0 {
		r.Loop, r.Rate, r.MaxInflight = "open", c.rate, c.maxInflight
	} else {
		r.Loop, r.Concurrency = "closed", c.concurrency
	}
	if len(r.FreeErrors) == 0 {
		r.FreeErrors = nil
	}
	r.Calls = len(p.lat)
	for _, n := range p.errs {
		r.Calls += n
	}
	if r.WallSeconds > 0 {
		r.ClientCores = r.ClientCPU / r.WallSeconds
	}
	if r.Calls > 0 {
		r.AchievedRate = float64(r.Calls) / r.WallSeconds
		r.ClientCPUUs = r.ClientCPU / float64(r.Calls) * 1e6
	}
	slices.Sort(p.lat)
	ms := func(permille int) float64 { return float64(nearestRank(p.lat, permille)) / float64(time.Millisecond) }
	r.LatencyMs = latency{P50: ms(500), P90: ms(900), P99: ms(990), P999: ms(999), Max: ms(1000)}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		r.LoadAvg = strings.Join(strings.Fields(string(b))[:3], " ")
	}
	return r
}

// nearestRank returns the permille-th per-mille percentile of sorted by the nearest-rank method:
// the smallest value that at least that share of the values do not exceed. Integer arithmetic
// keeps the rank exact (0.999 × 1000 is not 999 in floating point everywhere).
func nearestRank(sorted []time.Duration, permille int) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := (permille*len(sorted) + 999) / 1000
	return sorted[max(rank, 1)-1]
}

func (r *report) setServerCPU(seconds float64) {
	r.ServerCPU = &seconds
	if r.WallSeconds > 0 {
		cores := seconds / r.WallSeconds
		r.ServerCores = &cores
	}
	if r.Calls > 0 {
		us := seconds / float64(r.Calls) * 1e6
		r.ServerCPUUs = &us
	}
}

// write prints the report as text.
func (r *report) write(w io.Writer) {
	loop := fmt.Sprintf("closed loop of %d callers", r.Concurrency)
	if r.Loop == "open" {
		loop = fmt.Sprintf("open loop at %g calls/s (at most %d in flight)", r.Rate, r.MaxInflight)
	}
	free := ""
	if r.Free {
		free = ", each freed after"
	}
	conns := "connections"
	if r.Conns == 1 {
		conns = "connection"
	}
	if r.Loop == "closed" && r.Concurrency == 0 {
		fmt.Fprintf(w, "kvload: no Route calls (--concurrency 0): %.2f s of ingest alone\n", r.WallSeconds)
	} else {
		fmt.Fprintf(w, "kvload: %s Route%s, %s over %d %s, %d prompts of %d tokens\n",
			r.Mode, free, loop, r.Conns, conns, r.Prompts, r.RouteTokens)
		fmt.Fprintf(w, "  calls:    %d in %.2f s (after %d warmup calls), %.0f calls/s; errors: %s\n",
			r.Calls, r.WallSeconds, r.Warmup, r.AchievedRate, codes(r.Errors))
	}
	if r.FreeErrors != nil {
		fmt.Fprintf(w, "  Free errors: %s\n", codes(r.FreeErrors))
	}
	if r.Loop == "open" {
		fmt.Fprintf(w, "  late:     %d calls started over %v past due, %d found every in-flight slot busy\n", r.LateStarts, lateAfter, r.Capped)
	}
	if l := r.LatencyMs; r.Calls > 0 {
		fmt.Fprintf(w, "  latency:  p50 %.3f ms, p90 %.3f ms, p99 %.3f ms, p99.9 %.3f ms, max %.3f ms\n", l.P50, l.P90, l.P99, l.P999, l.Max)
	}
	if r.Ingest != nil {
		r.Ingest.write(w)
	}
	fmt.Fprintf(w, "  CPU:      kvload %.2f s (%.2f cores), %.1f µs per call", r.ClientCPU, r.ClientCores, r.ClientCPUUs)
	if r.ServerCPU != nil {
		fmt.Fprintf(w, "; kvrouter %.2f s", *r.ServerCPU)
		if r.ServerCores != nil {
			fmt.Fprintf(w, " (%.2f cores)", *r.ServerCores)
		}
		if r.ServerCPUUs != nil {
			fmt.Fprintf(w, ", %.1f µs per call", *r.ServerCPUUs)
		}
	}
	if r.Ingest != nil {
		fmt.Fprint(w, " (both with the ingest's share)")
	}
	fmt.Fprintf(w, "\n  load average: %s\n", r.LoadAvg)
}

// codes formats errors by code, in order of code name.
func codes(errs map[string]int) string {
	if len(errs) == 0 {
		return "none"
	}
	var parts []string
	for _, code := range slices.Sorted(maps.Keys(errs)) {
		parts = append(parts, fmt.Sprintf("%s %d", code, errs[code]))
	}
	return strings.Join(parts, ", ")
}

// writeJSON writes the report to path as one JSON object.
func (r *report) writeJSON(path string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// processCPU returns the user and system CPU time kvload has used so far.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// cpuReader reads the CPU seconds a process has used so far.
type cpuReader func(ctx context.Context) (float64, error)

// serverCPU returns the reader of the router's CPU time the command line names, or nil.
func serverCPU(c *config) cpuReader {
	switch {
	case c.serverPID != 0:
		return func(context.Context) (float64, error) { return pidCPU(c.serverPID) }
	case c.serverMetrics != "":
		return func(ctx context.Context) (float64, error) { return metricsCPU(ctx, c.serverMetrics) }
	}
	return nil
}

// userHZ is the unit of the CPU times in /proc/PID/stat: the kernel reports them in USER_HZ
// ticks, 100 per second on every Linux architecture Go runs on.
const userHZ = 100

// pidCPU reads the user and system time of process pid from /proc/PID/stat (utime and stime, its
// fields 14 and 15; the fields are counted after the command name, which may hold spaces).
func pidCPU(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(fields) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: too few fields", pid)
	}
	utime, err1 := strconv.ParseUint(fields[11], 10, 64)
	stime, err2 := strconv.ParseUint(fields[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("/proc/%d/stat: bad utime or stime %q %q", pid, fields[11], fields[12])
	}
	return float64(utime+stime) / userHZ, nil
}

// metricsCPU reads process_cpu_seconds_total from a Prometheus text endpoint: the standard Go
// process collector that kvrouter serve exposes on its --metrics-listen address.
func metricsCPU(ctx context.Context, url string) (float64, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "process_cpu_seconds_total "); ok {
			return strconv.ParseFloat(strings.TrimSpace(v), 64)
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("GET %s: no process_cpu_seconds_total", url)
}
