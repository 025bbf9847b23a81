package main

import (
	"fmt"
	"runtime"
	"runtime/debug"
)

// version is kvrouter's release. The file VERSION at the repository's root, the Python client's
// pyproject.toml and the TypeScript client's package.json carry the same; TestVersionsAgree keeps
// them equal.
const version = "0.1.0"

// commit is the git commit the binary was built from, when the build says it with
// -ldflags "-X main.commit=$(git rev-parse HEAD)" (the Dockerfile does). Otherwise it comes from the
// version-control stamp that `go build` writes in a git checkout, if it wrote one.
var commit string

// versionLine is what `kvrouter --version` prints: the release, the commit (with "+dirty" when
// the tree had uncommitted changes) and the Go release that built the binary.
func versionLine() string {
	rev, dirty := commit, false
	if info, ok := debug.ReadBuildInfo(); ok && rev == "" {
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
	}
	switch {
	case rev == "":
		rev = "unknown"
	case dirty:
		rev += "+dirty"
	}
	return fmt.Sprintf("kvrouter %s (commit %s, %s)", version, rev, runtime.Version())
}
