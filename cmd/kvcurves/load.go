package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"regexp"
	"strconv"
	"time"
)

// kvloadReport is the part of kvload's --json report the curves use.
type kvloadReport struct {
	Calls        int            `json:"calls"`
	Errors       map[string]int `json:"errors"`
	AchievedRate float64        `json:"achieved_rate"`
	LatencyMs    struct {
		P50 float64 `json:"p50"`
		P99 float64 `json:"p99"`
	} `json:"latency_ms"`
	ClientCPUUs float64  `json:"client_cpu_us_per_call"`
	ServerCPUUs *float64 `json:"server_cpu_us_per_call"`
}

// seededLine is kvload's line on seeding: how many blocks it published and how long the router
// took to ack them all (from the first Publish message to the last ack; generating the events
// comes before and is not counted).
var seededLine = regexp.MustCompile(`kvload: seeded .*: \d+ stored events, (\d+) blocks, acked in (\S+)`)

// parseSeeded returns the blocks and ack time of kvload's seeding line in log.
func parseSeeded(log []byte) (blocks int, acked time.Duration, err error) {
	m := seededLine.FindSubmatch(log)
	if m == nil {
		return 0, 0, fmt.Errorf("no seeding line (%q) in kvload's output", "kvload: seeded ...")
	}
	blocks, _ = strconv.Atoi(string(m[1]))
	acked, err = time.ParseDuration(string(m[2]))
	return blocks, acked, err
}

// runKvload is `kvcurves kvload`: it prints a kvload run as Go benchmark lines, so that the
// load-test curves are summarized and compared like every other benchmark.
func runKvload(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("kvload", stderr, "kvcurves kvload [-name NAME -json REPORT] [-seed-name NAME -log KVLOAD_OUTPUT]")
	name := fs.String("name", "", "benchmark name of the Route calls (without the Benchmark prefix)")
	jsonPath := fs.String("json", "", "kvload's --json report")
	seedName := fs.String("seed-name", "", "benchmark name of the seeding (without the Benchmark prefix)")
	logPath := fs.String("log", "", "kvload's output, with its seeding line")
	if code, done := parse(fs, args); done {
		return code
	}
	if *name != "" && *jsonPath != "" {
		b, err := os.ReadFile(*jsonPath)
		if err != nil {
			fmt.Fprintf(stderr, "kvcurves: %v\n", err)
			return 1
		}
		var r kvloadReport
		if err := json.Unmarshal(b, &r); err != nil {
			fmt.Fprintf(stderr, "kvcurves: %s: %v\n", *jsonPath, err)
			return 1
		}
		errs := 0
		for _, n := range r.Errors {
			errs += n
		}
		line := fmt.Sprintf("Benchmark%s \t%d \t%.0f req/s \t%.0f p50-ns \t%.0f p99-ns \t%.1f client-cpu-us/op \t%d errors",
			*name, r.Calls, r.AchievedRate, r.LatencyMs.P50*1e6, r.LatencyMs.P99*1e6, r.ClientCPUUs, errs)
		if r.ServerCPUUs != nil {
			line += fmt.Sprintf(" \t%.1f server-cpu-us/op", *r.ServerCPUUs)
		}
		fmt.Fprintln(stdout, line)
	}
	if *seedName != "" && *logPath != "" {
		b, err := os.ReadFile(*logPath)
		if err != nil {
			fmt.Fprintf(stderr, "kvcurves: %v\n", err)
			return 1
		}
		blocks, acked, err := parseSeeded(b)
		if err != nil {
			fmt.Fprintf(stderr, "kvcurves: %s: %v\n", *logPath, err)
			return 1
		}
		fmt.Fprintf(stdout, "Benchmark%s \t1 \t%d published-blocks \t%.0f acked-blocks/s \t%.1f ack-ms\n",
			*seedName, blocks, float64(blocks)/acked.Seconds(), float64(acked)/float64(time.Millisecond))
	}
	return 0
}

// runFreePort is `kvcurves freeport`: it prints a TCP port free on 127.0.0.1 (the kernel's pick),
// for a redis-server, which cannot be told to pick one itself and report it.
func runFreePort(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("freeport", stderr, "kvcurves freeport")
	if code, done := parse(fs, args); done {
		return code
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintf(stderr, "kvcurves: %v\n", err)
		return 1
	}
	defer l.Close()
	fmt.Fprintln(stdout, l.Addr().(*net.TCPAddr).Port)
	return 0
}
