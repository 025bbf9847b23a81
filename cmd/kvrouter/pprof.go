package main

import (
	"net/http"
	"net/http/pprof"
	"runtime"
)

// servePprof adds Go's profiler under /debug/pprof/ (--pprof). It is registered on the metrics mux
// by hand, not by importing net/http/pprof for its side effect, which would put it on
// http.DefaultServeMux for anything else that serves that. Mutex and block profiling are turned on
// at a low rate, so that lock waits between ingestion and Route show up: a mutex profile samples one
// contention event in 100, a block profile one blocking event per 100 µs spent blocked.
func servePprof(mux *http.ServeMux) {
	runtime.SetMutexProfileFraction(100)
	runtime.SetBlockProfileRate(100_000)
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
}
