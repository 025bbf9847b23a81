package trace

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Find returns the path of a trace file by name ("mooncake_conversation_trace.jsonl"): in
// $KVROUTER_TRACES when set, else in the traces folder of the checkout that holds the working
// directory (the repository ships its public traces there, see traces/README.md).
func Find(name string) (string, error) {
	var dirs []string
	if d := os.Getenv("KVROUTER_TRACES"); d != "" {
		dirs = append(dirs, d)
	}
	if root, ok := checkoutRoot(); ok {
		dirs = append(dirs, filepath.Join(root, "traces"))
	}
	for _, d := range dirs {
		p := filepath.Join(d, name)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		} else if !errors.Is(err, os.ErrNotExist) {
			return "", err
		}
	}
	if len(dirs) == 0 {
		return "", fmt.Errorf("trace %s: the working directory is not inside a kvrouter checkout; set KVROUTER_TRACES to the folder holding it, or give the file's path", name)
	}
	return "", fmt.Errorf("trace %s not found in %v (set KVROUTER_TRACES to its folder, or give the file's path)", name, dirs)
}

// checkoutRoot returns the repository's root: the nearest folder at or above the working directory
// whose go.mod declares kvrouter's root module (the client and gen modules inside it declare
// others).
func checkoutRoot() (string, bool) {
	wd, err := os.Getwd()
	if err != nil {
		return "", false
	}
	for d := wd; ; d = filepath.Dir(d) {
		if data, err := os.ReadFile(filepath.Join(d, "go.mod")); err == nil && isRootModule(data) {
			return d, true
		}
		if filepath.Dir(d) == d {
			return "", false
		}
	}
}

// isRootModule reports whether a go.mod declares the repository's root module.
func isRootModule(gomod []byte) bool {
	for _, line := range strings.Split(string(gomod), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "module" {
			return strings.Trim(f[1], `"`) == "github.com/kvrouter/kvrouter"
		}
	}
	return false
}
