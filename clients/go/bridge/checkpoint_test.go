package bridge

import (
	"os"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// TestCheckpointFile: a checkpoint written is read back by a bridge of the same worker rank,
// engine and settings; any other, or a damaged file, is refused with a reason (the bridge then
// starts afresh); no file is no checkpoint.
func TestCheckpointFile(t *testing.T) {
	dir := t.TempDir()
	hello := &kvrouterv1.WorkerHello{Endpoint: "10.0.0.1:8000", WorkerId: 5, DpRank: 1, Model: "m", Role: kvrouterv1.WorkerRole_WORKER_ROLE_DECODE, BlockSize: 16, TotalKvBlocks: 1000}
	f := newCheckpointFile(dir, hello, "tcp://127.0.0.1:5558")
	if cp, err := f.load(); cp != nil || err != nil {
		t.Fatalf("load() without a file = %v, %v; want nothing", cp, err)
	}
	a := batchAck{batch: batchRef{seq: 41, digest: 0xfeed}, eventID: 977, ok: true}
	if err := f.save(a); err != nil {
		t.Fatal(err)
	}
	cp, err := f.load()
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]uint64{41, 0xfeed, 977}, []uint64{cp.Seq, cp.Digest, cp.EventID}); diff != "" {
		t.Errorf("checkpoint read back (-want +got):\n%s", diff)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Errorf("state directory holds %d files, want 1 (no temporary file left)", len(entries))
	}

	changed := func(mutate func(*kvrouterv1.WorkerHello)) *kvrouterv1.WorkerHello {
		h := &kvrouterv1.WorkerHello{}
		*h = kvrouterv1.WorkerHello{Endpoint: hello.Endpoint, WorkerId: hello.WorkerId, DpRank: hello.DpRank, Model: hello.Model, Role: hello.Role, BlockSize: hello.BlockSize, TotalKvBlocks: hello.TotalKvBlocks}
		mutate(h)
		return h
	}
	for name, other := range map[string]*checkpointFile{
		"another engine":   newCheckpointFile(dir, hello, "tcp://127.0.0.1:6000"),
		"another capacity": newCheckpointFile(dir, changed(func(h *kvrouterv1.WorkerHello) { h.TotalKvBlocks = 2000 }), "tcp://127.0.0.1:5558"),
		"another role":     newCheckpointFile(dir, changed(func(h *kvrouterv1.WorkerHello) { h.Role = kvrouterv1.WorkerRole_WORKER_ROLE_PREFILL }), "tcp://127.0.0.1:5558"),
	} {
		if cp, err := other.load(); cp != nil || err == nil || !strings.Contains(err.Error(), "another worker, engine or configuration") {
			t.Errorf("%s: load() = %v, %v; want refused", name, cp, err)
		}
	}
	if err := os.WriteFile(f.path, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if cp, err := f.load(); cp != nil || err == nil {
		t.Errorf("damaged file: load() = %v, %v; want refused", cp, err)
	}
}
