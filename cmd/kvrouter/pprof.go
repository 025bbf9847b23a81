package main

import (
	"fmt"
	"net/http"
	"net/http/pprof"
	"runtime"
	"strconv"
)

// servePprof adds Go's profiler under /debug/pprof/ (--pprof), served on its own loopback listener
// (--pprof-listen): it answers without authentication, shows the process's internals and costs CPU
// while it runs, so it is never on the metrics port that Prometheus (and so the network) reaches;
// reach it with kubectl port-forward or ssh. A CPU profile or trace runs at most
// maxProfileSeconds. It is registered by hand, not by importing net/http/pprof for its side
// effect, which would put it on http.DefaultServeMux for anything else that serves that. Mutex and block profiling are turned on
// at a low rate, so that lock waits between ingestion and Route show up: a mutex profile samples one
// contention event in 100, a block profile one blocking event per 100 µs spent blocked.
func servePprof(mux *http.ServeMux) {
	runtime.SetMutexProfileFraction(100)
	runtime.SetBlockProfileRate(100_000)
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", boundedSeconds(pprof.Profile))
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", boundedSeconds(pprof.Trace))
}

// maxProfileSeconds bounds how long one CPU profile or trace runs (and holds a connection).
const maxProfileSeconds = 60

// boundedSeconds refuses a profile asking to run longer than maxProfileSeconds, or for a number of
// seconds that is not one.
func boundedSeconds(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if v := r.URL.Query().Get("seconds"); v != "" {
			if s, err := strconv.ParseFloat(v, 64); err != nil || !(s > 0 && s <= maxProfileSeconds) {
				http.Error(w, fmt.Sprintf("seconds: must be a number of seconds above 0 and at most %d (got %q)", maxProfileSeconds, v), http.StatusBadRequest)
				return
			}
		}
		h(w, r)
	}
}
