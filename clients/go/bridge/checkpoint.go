package bridge

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/cespare/xxhash/v2"
	"google.golang.org/protobuf/proto"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// checkpoint is what a rank's checkpoint file holds: the newest engine batch whose every event the
// router acked, and the id of its last event, for the worker rank and the engine the file names.
// A bridge that restarts resumes from it: the router still holds the worker's blocks (within its
// grace period), and the engine's replay buffer holds the batches after this one. Any older
// checkpoint is as safe, only slower: applying a batch the router already holds again leaves it as
// it was, so a checkpoint lost with the last seconds before a crash costs nothing.
type checkpoint struct {
	Version  int       `json:"version"`
	WorkerID uint64    `json:"worker_id"`
	DPRank   uint32    `json:"dp_rank"`
	Model    string    `json:"model"`
	Engine   string    `json:"engine_endpoint"`
	Hello    uint64    `json:"hello_digest"` // the registration's settings: a changed one starts afresh
	Seq      uint64    `json:"seq"`
	Digest   uint64    `json:"payload_digest"`
	EventID  uint64    `json:"event_id"`
	Written  time.Time `json:"written"`
}

const checkpointVersion = 1

// checkpointFile is one rank's checkpoint file in the bridge's state directory.
type checkpointFile struct {
	path string
	want checkpoint // the fields that must match for a checkpoint to apply
	// Used by the writer only: the last checkpoint written, and when a failure was last logged.
	written       batchAck
	failureLogged time.Time
}

func newCheckpointFile(dir string, hello *kvrouterv1.WorkerHello, engine string) *checkpointFile {
	settings := proto.Clone(hello).(*kvrouterv1.WorkerHello)
	settings.FreshStart = false
	encoded, _ := proto.MarshalOptions{Deterministic: true}.Marshal(settings)
	return &checkpointFile{
		path: filepath.Join(dir, fmt.Sprintf("bridge-worker-%d-dp-%d.json", hello.GetWorkerId(), hello.GetDpRank())),
		want: checkpoint{Version: checkpointVersion, WorkerID: hello.GetWorkerId(), DPRank: hello.GetDpRank(), Model: hello.GetModel(),
			Engine: engine, Hello: xxhash.Sum64(encoded)},
	}
}

// load returns the checkpoint to resume from: nil without one, an error for one that does not apply
// (another worker, engine or configuration, or not readable).
func (f *checkpointFile) load() (*checkpoint, error) {
	data, err := os.ReadFile(f.path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var cp checkpoint
	if err := json.Unmarshal(data, &cp); err != nil {
		return nil, fmt.Errorf("not a checkpoint: %w", err)
	}
	got, want := cp, f.want
	got.Seq, got.Digest, got.EventID, got.Written = 0, 0, 0, time.Time{}
	if got != want {
		return nil, fmt.Errorf("written for another worker, engine or configuration (worker %d rank %d model %q engine %s, version %d)",
			cp.WorkerID, cp.DPRank, cp.Model, cp.Engine, cp.Version)
	}
	return &cp, nil
}

// save writes the checkpoint of batch a, unless it was the last one written. The file is replaced
// whole (written aside, synced, renamed), so a crash leaves the old one or the new one.
func (f *checkpointFile) save(a batchAck) error {
	if !a.ok || a == f.written {
		return nil
	}
	cp := f.want
	cp.Seq, cp.Digest, cp.EventID, cp.Written = a.batch.seq, a.batch.digest, a.eventID, time.Now().UTC()
	data, err := json.Marshal(cp)
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(f.path), filepath.Base(f.path)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // after the rename, nothing is there
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), f.path); err != nil {
		return err
	}
	f.written = a
	return nil
}
