// Binary kvcurves turns the raw output of scripts/bench.sh into what docs/benchmarks holds: the
// scaling curves as PNG plots and Markdown tables, and the comparison of a run's headline metrics
// with the committed ones. It also carries the small helpers the load-test steps of bench.sh
// need, so that the script stays plain shell.
//
// Every input is Go benchmark lines ("BenchmarkName N value unit ..."), whether from `go test
// -bench`, the env-gated curve tests (policy/curves_test.go, kvstate/curves_test.go) or the load
// tests (converted here from kvload's report): one format that benchstat, scripts/summarize.awk and
// kvcurves all read. Repeated lines of one name are runs; kvcurves shows their median [min – max].
//
// Usage:
//
//	kvcurves plot -out DIR [-md FILE] [-machine FILE] RESULTS...   PNG per curve, tables into FILE
//	kvcurves compare -baseline FILE [-update all|missing] RESULTS... headline metrics vs committed
//	kvcurves kvload -name NAME -json REPORT [-seed-name NAME -log OUTPUT]   kvload run as bench lines
//	kvcurves replicate -redis ADDR -replicas A,B -ack-file F -log OUTPUT -name NAME   Redis curve point
//	kvcurves ready -replicas A,B                                   wait for replicas to join the log
//	kvcurves freeport                                              print a free loopback TCP port
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
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	os.Exit(run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

const usage = `kvcurves plots and compares the output of scripts/bench.sh.

Usage:
  kvcurves plot -out DIR [-md FILE] [-machine FILE] RESULTS...
  kvcurves compare [-baseline FILE] [-threshold 0.2] [-update all|missing] [-strict] RESULTS...
  kvcurves kvload [-name NAME -json REPORT] [-seed-name NAME -log KVLOAD_OUTPUT]
  kvcurves replicate -redis ADDR -replicas ADDR,... -ack-file FILE -log KVLOAD_OUTPUT -name NAME
  kvcurves ready -replicas ADDR,...
  kvcurves freeport
`

// run executes the command line and returns the exit code: 0 done, 1 failed, 2 bad command line.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	rest := args[1:]
	switch args[0] {
	case "plot":
		return runPlot(rest, stdout, stderr)
	case "compare":
		return runCompare(rest, stdout, stderr)
	case "kvload":
		return runKvload(rest, stdout, stderr)
	case "replicate":
		return runReplicate(ctx, rest, stdout, stderr)
	case "ready":
		return runReady(ctx, rest, stderr)
	case "freeport":
		return runFreePort(rest, stdout, stderr)
	case "-h", "--help", "help":
		fmt.Fprint(stdout, usage)
		return 0
	}
	fmt.Fprintf(stderr, "kvcurves: unknown command %q\n\n%s", args[0], usage)
	return 2
}

// newFlagSet returns a subcommand's flag set, printing synopsis above the flags on -h.
func newFlagSet(name string, stderr io.Writer, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet("kvcurves "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: %s\n", synopsis)
		fs.PrintDefaults()
	}
	return fs
}

// parse parses a subcommand's flags; done says the command is over, with code as its status
// (0 after -h, 2 after a bad flag).
func parse(fs *flag.FlagSet, args []string) (code int, done bool) {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0, true
		}
		return 2, true
	}
	return 0, false
}

// runPlot is `kvcurves plot`: one PNG per curve with points in the results, into -out, and the
// curves' tables into the Markdown file -md (regions between kvcurves markers are replaced, the
// rest of the file is kept).
func runPlot(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("plot", stderr, "kvcurves plot -out DIR [-md FILE] [-machine FILE] RESULTS...")
	out := fs.String("out", "", "directory of the PNG plots")
	md := fs.String("md", "", "Markdown file of the tables (default: DIR/curves.md)")
	machine := fs.String("machine", "", "the run's machine.txt, quoted at the top of the Markdown file")
	if code, done := parse(fs, args); done {
		return code
	}
	if *out == "" {
		fmt.Fprintln(stderr, "kvcurves plot: -out is required")
		return 2
	}
	if *md == "" {
		*md = filepath.Join(*out, "curves.md")
	}
	res := newResults()
	if err := res.readFiles(fs.Args()...); err != nil {
		fmt.Fprintf(stderr, "kvcurves: %v\n", err)
		return 1
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		fmt.Fprintf(stderr, "kvcurves: %v\n", err)
		return 1
	}
	drawn := map[string]bool{}
	for i := range curves {
		c := &curves[i]
		path := filepath.Join(*out, c.id+".png")
		ok, err := c.figure(res, path)
		if err != nil {
			fmt.Fprintf(stderr, "kvcurves: %s: %v\n", c.id, err)
			return 1
		}
		if ok {
			drawn[c.id] = true
			fmt.Fprintf(stdout, "== %s (%s)\n%s\n", c.title, path, c.table(res))
		}
	}
	var machineText string
	if *machine != "" {
		b, err := os.ReadFile(*machine)
		if err != nil {
			fmt.Fprintf(stderr, "kvcurves: %v\n", err)
			return 1
		}
		machineText = string(b)
	}
	if err := writeMarkdown(*md, machineText, res, drawn); err != nil {
		fmt.Fprintf(stderr, "kvcurves: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "tables in %s\n", *md)
	return 0
}
