package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
)

// TestVersion: `kvrouter --version` prints the release, the commit the build was given and the Go
// release, on stdout, and exits 0.
func TestVersion(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "kvrouter")
	const rev = "0123456789abcdef0123456789abcdef01234567"
	if out, err := exec.Command("go", "build", "-ldflags", "-X main.commit="+rev, "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build = %v\n%s", err, out)
	}
	for _, arg := range []string{"--version", "version"} {
		var stdout, stderr bytes.Buffer
		cmd := exec.Command(bin, arg)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			t.Fatalf("kvrouter %s = %v\n%s", arg, err, stderr.String())
		}
		want := "kvrouter " + version + " (commit " + rev + ", " + runtime.Version() + ")\n"
		if stdout.String() != want || stderr.Len() != 0 {
			t.Errorf("kvrouter %s printed %q (stderr %q), want %q", arg, stdout.String(), stderr.String(), want)
		}
	}
	var stderr bytes.Buffer
	if code := run(t.Context(), []string{"--version", "extra"}, func(string) string { return "" }, io.Discard, &stderr); code != 2 {
		t.Errorf("--version with an extra argument = %d, want 2 and the usage", code)
	}
}

// TestVersionsAgree: the binary, the file VERSION and the Python and TypeScript packages name one
// release.
func TestVersionsAgree(t *testing.T) {
	read := func(path string) string {
		b, err := os.ReadFile(filepath.Join("..", "..", path))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	if got := strings.TrimSpace(read("VERSION")); got != version {
		t.Errorf("VERSION says %q, the binary %q", got, version)
	}
	m := regexp.MustCompile(`(?m)^version\s*=\s*"([^"]+)"`).FindStringSubmatch(read("clients/python/pyproject.toml"))
	if m == nil || m[1] != version {
		t.Errorf("clients/python/pyproject.toml's version = %v, want %q", m, version)
	}
	var pkg struct{ Version string }
	if err := json.Unmarshal([]byte(read("clients/ts/package.json")), &pkg); err != nil || pkg.Version != version {
		t.Errorf("clients/ts/package.json's version = %q (%v), want %q", pkg.Version, err, version)
	}
}
