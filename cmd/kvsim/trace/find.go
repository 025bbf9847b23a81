package trace

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// Find returns the path of a trace file by name ("mooncake_conversation_trace.jsonl"): in
// $KVROUTER_TRACES when set, else in shared/traces beside the checkout (the folder above the one
// holding go.mod, as the workplace lays it out), else in /work/shared/traces.
func Find(name string) (string, error) {
	var dirs []string
	if d := os.Getenv("KVROUTER_TRACES"); d != "" {
		dirs = append(dirs, d)
	}
	if wd, err := os.Getwd(); err == nil {
		for d := wd; ; d = filepath.Dir(d) {
			if _, err := os.Stat(filepath.Join(d, "go.mod")); err == nil {
				dirs = append(dirs, filepath.Join(filepath.Dir(d), "shared", "traces"))
				break
			}
			if filepath.Dir(d) == d {
				break
			}
		}
	}
	dirs = append(dirs, "/work/shared/traces")
	for _, d := range dirs {
		p := filepath.Join(d, name)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		} else if !errors.Is(err, os.ErrNotExist) {
			return "", err
		}
	}
	return "", fmt.Errorf("trace %s not found in %v (set KVROUTER_TRACES to its folder)", name, dirs)
}
