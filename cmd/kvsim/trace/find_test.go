package trace

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestFind: $KVROUTER_TRACES comes first, then the checkout's traces/; a trace in neither is an
// error naming where it looked, and nothing outside the checkout is searched.
func TestFind(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "mine.jsonl"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("KVROUTER_TRACES", dir)
	if got, err := Find("mine.jsonl"); err != nil || got != filepath.Join(dir, "mine.jsonl") {
		t.Errorf("Find(mine.jsonl) = %q, %v; want it in $KVROUTER_TRACES", got, err)
	}
	got, err := Find("mooncake_conversation_trace.jsonl")
	if err != nil || filepath.Base(filepath.Dir(got)) != "traces" {
		t.Errorf("Find(mooncake) = %q, %v; want the checkout's traces/", got, err)
	}
	root := filepath.Dir(filepath.Dir(got))
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Errorf("Find(mooncake) = %q: not in the traces/ beside the root go.mod", got)
	}
	_, err = Find("absent.csv")
	if err == nil || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), filepath.Join(root, "traces")) {
		t.Errorf("Find(absent.csv) error = %v; want one naming %s and %s", err, dir, filepath.Join(root, "traces"))
	}

	t.Setenv("KVROUTER_TRACES", "")
	t.Chdir(t.TempDir())
	if r, inside := checkoutRoot(); inside {
		t.Skipf("the temporary folder is inside the checkout %s", r)
	}
	if _, err := Find("mooncake_conversation_trace.jsonl"); err == nil || !strings.Contains(err.Error(), "not inside a kvrouter checkout") {
		t.Errorf("Find outside a checkout: error = %v; want one saying so", err)
	}
}

func TestIsRootModule(t *testing.T) {
	tests := []struct {
		gomod string
		want  bool
	}{
		{"module github.com/kvrouter/kvrouter\n\ngo 1.26\n", true},
		{"// a comment\nmodule \"github.com/kvrouter/kvrouter\"\n", true},
		{"module github.com/kvrouter/kvrouter/clients/go\n", false},
		{"go 1.26\n", false},
	}
	for _, tt := range tests {
		if got := isRootModule([]byte(tt.gomod)); got != tt.want {
			t.Errorf("isRootModule(%q) = %v, want %v", tt.gomod, got, tt.want)
		}
	}
}
