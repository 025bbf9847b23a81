// Package docs holds no code: its test checks that the repository's Markdown names only paths
// that exist, so a moved or deleted file cannot leave a dead pointer in the documentation.
package docs

import (
	"fmt"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// repoRoot is the repository root as seen from this package's directory, where go test runs.
const repoRoot = ".."

// skippedDocs are docs the test does not read, keyed by path from the repository root, with the
// reason.
var skippedDocs = map[string]string{}

// allowed are paths a doc names on purpose although the repository does not hold them, each with
// the reason. Keys are slash-separated paths from the repository root; a key ending in "/" allows
// everything under it.
var allowed = map[string]string{
	".tmp/": "the git-ignored scratch directory scripts/tools.sh and scripts/bench.sh create",
}

// extraTopDirs are top-level directory names that a doc might use although the repository has no
// such directory (the peer-index harness and the public traces are kept beside the project, not in
// it), so that a backticked mention of them is checked rather than taken for prose.
var extraTopDirs = []string{"bench", "traces"}

// fileExtensions mark a backticked span containing a '/' as a path even when its first element is
// not a top-level directory of the repository.
var fileExtensions = []string{
	".go", ".md", ".proto", ".sh", ".yaml", ".yml", ".py", ".ts", ".js", ".json", ".jsonl",
	".txt", ".png", ".toml", ".mod", ".sum",
}

// A reference is one path a doc names: where, how it was written, and what it resolves to.
type reference struct {
	line    int    // 1-based line of the doc where the reference starts
	written string // the path as the doc writes it (fragment stripped)
	target  string // slash-separated path relative to the repository root
}

var (
	// fenceRE matches the opening or closing line of a fenced code block.
	fenceRE = regexp.MustCompile("^\\s*(```|~~~)")
	// codeSpanRE matches a one-backtick inline code span (the docs use no longer backtick runs
	// outside fences).
	codeSpanRE = regexp.MustCompile("`([^`]+)`")
	// linkRE matches an inline Markdown link or image target, with an optional "title".
	linkRE = regexp.MustCompile(`\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)`)
)

// TestDocPathsExist fails for every path named in README.md, docs/*.md and docs/*/*.md that does
// not exist, so that a doc cannot keep pointing at a moved or deleted file.
//
// The heuristic, kept simple on purpose:
//   - Markdown link targets (outside code) that are relative paths are resolved against the doc's
//     directory, after any #fragment or ?query is dropped; http(s), mailto, other schemes and
//     #anchors are skipped. A target starting with "/" is taken from the repository root.
//   - Inline code spans (outside fenced code blocks) are taken as paths when they contain a '/' and
//     either start with a top-level directory of the repository (or one of extraTopDirs) or end in
//     one of fileExtensions; they are resolved against the repository root. Spans containing a
//     space, '*', '<', '{' or '$', flags (leading '-'), URLs ("://") and Go import paths
//     (github.com/...) are prose or patterns, not paths, and are skipped; so is a span that is a
//     link's whole text, whose target is checked instead. A trailing ":LINE" or
//     ":Identifier" after a file is dropped, and a trailing ".Identifier" after a directory
//     (`server/app.Dispatcher`) is accepted when the directory exists.
//
// Bare file names without a '/' (`errors.go`) are relative to whatever the sentence is about, so
// they are not checked; nor are paths in fenced code blocks (commands), reference-style link
// definitions (the docs use none) or HTML.
func TestDocPathsExist(t *testing.T) {
	docs := []string{"README.md"}
	for _, pattern := range []string{"*.md", "*/*.md"} {
		matches, err := filepath.Glob(filepath.Join(repoRoot, "docs", pattern))
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range matches {
			rel, err := filepath.Rel(repoRoot, m)
			if err != nil {
				t.Fatal(err)
			}
			doc := filepath.ToSlash(rel)
			if _, skip := skippedDocs[doc]; skip {
				continue
			}
			docs = append(docs, doc)
		}
	}
	sort.Strings(docs)
	if len(docs) < 2 {
		t.Fatalf("found only %v: is the test running in docs/?", docs)
	}

	topDirs := topLevelDirs(t)
	for _, doc := range docs {
		text, err := os.ReadFile(filepath.Join(repoRoot, filepath.FromSlash(doc)))
		if err != nil {
			t.Fatal(err)
		}
		for _, ref := range extractReferences(doc, string(text), topDirs) {
			if !allowedPath(ref.target) && !exists(ref.target) {
				t.Errorf("%s:%d: `%s` does not exist", doc, ref.line, ref.written)
			}
		}
	}
}

// TestExtractReferences pins the heuristic on small inputs, so that a change to it is deliberate.
func TestExtractReferences(t *testing.T) {
	topDirs := map[string]bool{"kvstate": true, "docs": true, "cmd": true, ".ci": true}
	tests := []struct {
		name string
		doc  string
		text string
		want []string // "line:target"
	}{
		{"link relative to the doc", "docs/a.md", "see [b](b.md#part)", []string{"1:docs/b.md"}},
		{"link up from docs", "docs/a.md", "[r](../README.md)", []string{"1:README.md"}},
		{"link from the root", "README.md", "[d](docs/x.md)", []string{"1:docs/x.md"}},
		{"image", "docs/a.md", "![p](benchmarks/p.png)", []string{"1:docs/benchmarks/p.png"}},
		{"urls and anchors skipped", "docs/a.md", "[u](https://x.org/a.md) [m](mailto:a@b) [h](#top)", nil},
		{"code span by top dir", "README.md", "x\n`kvstate/replication/` y", []string{"2:kvstate/replication"}},
		{"code span by extension", "README.md", "`clients/go/x.go`", []string{"1:clients/go/x.go"}},
		{"leading ./", "README.md", "`./cmd/kvrouter`", []string{"1:cmd/kvrouter"}},
		{"dot dir", "README.md", "`.ci/run`", []string{"1:.ci/run"}},
		{"bare file name skipped", "README.md", "`errors.go`", nil},
		{"prose with a slash skipped", "README.md", "`microsoft/vidur` `a/b`", nil},
		{"command skipped", "README.md", "`scripts/bench.sh all`", nil},
		{"patterns skipped", "README.md", "`kvstate/*.go` `docs/<x>.md` `cmd/{a,b}` `$HOME/x.md`", nil},
		{"flag skipped", "README.md", "`--config=docs/x.yaml`", nil},
		{"import path skipped", "README.md", "`github.com/kvrouter/kvrouter/cmd/x`", nil},
		{"url skipped", "README.md", "`https://example.com/x.md`", nil},
		{"line number dropped", "README.md", "`kvstate/codec.go:42`", []string{"1:kvstate/codec.go"}},
		{"fenced block skipped", "README.md", "```sh\ncat `kvstate/x.go`\n[a](b.md)\n```\n`docs/y.md`", []string{"5:docs/y.md"}},
		{"link inside code span skipped", "README.md", "`[a](b.md)`", nil},
		{"code span as link text", "docs/a.md", "[`benchmarks/c.md`](benchmarks/c.md)", []string{"1:docs/benchmarks/c.md"}},
		{"span wrapped onto the next line", "README.md", "a `--x\ny` `cmd/a`", []string{"2:cmd/a"}},
		{"link wrapped before its target", "docs/a.md", "x\n[some\ntext](c.md)", []string{"3:docs/c.md"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got []string
			for _, ref := range extractReferences(tt.doc, tt.text, topDirs) {
				got = append(got, fmt.Sprintf("%d:%s", ref.line, ref.target))
			}
			if strings.Join(got, " ") != strings.Join(tt.want, " ") {
				t.Errorf("extractReferences(%q) = %q, want %q", tt.text, got, tt.want)
			}
		})
	}
}

// TestExists pins what counts as an existing target, against this repository's own tree.
func TestExists(t *testing.T) {
	tests := []struct {
		target string
		want   bool
	}{
		{"kvstate", true},
		{"docs/docs_test.go", true},
		{"server/app.Dispatcher", true}, // a package member
		{"server/app.go", false},        // a file, although server/app/ exists
		{"kvstate/no-such-file.go", false},
		{"no-such-dir/x", false},
	}
	for _, tt := range tests {
		if got := exists(tt.target); got != tt.want {
			t.Errorf("exists(%q) = %v, want %v", tt.target, got, tt.want)
		}
	}
}

// topLevelDirs lists the repository's top-level directories, read from disk so that a new one is
// checked without editing the test, plus extraTopDirs. .git and git-ignored scratch directories are
// left out: they are not part of the repository.
func topLevelDirs(t *testing.T) map[string]bool {
	t.Helper()
	entries, err := os.ReadDir(repoRoot)
	if err != nil {
		t.Fatal(err)
	}
	dirs := map[string]bool{}
	for _, e := range entries {
		switch name := e.Name(); {
		case !e.IsDir(), name == ".git", name == ".tmp", name == "node_modules":
		default:
			dirs[name] = true
		}
	}
	for _, d := range extraTopDirs {
		dirs[d] = true
	}
	return dirs
}

// extractReferences returns the paths that text, the contents of doc (a slash-separated path from
// the repository root), names, by the rules in TestDocPathsExist's comment. It reads text one
// block at a time (lines between blank lines or fences), so a code span wrapped onto the next line
// is still one span.
func extractReferences(doc, text string, topDirs map[string]bool) []reference {
	var refs []reference
	scan := func(block string, firstLine int) {
		lineAt := func(offset int) int { return firstLine + strings.Count(block[:offset], "\n") }
		for _, m := range codeSpanRE.FindAllStringSubmatchIndex(block, -1) {
			if m[0] > 0 && block[m[0]-1] == '[' && strings.HasPrefix(block[m[1]:], "](") {
				continue // a link's text: its target is checked below, relative to the doc
			}
			if p, ok := codePath(block[m[2]:m[3]], topDirs); ok {
				refs = append(refs, reference{line: lineAt(m[0]), written: p, target: path.Clean(p)})
			}
		}
		// Links inside code spans are examples, not links; blanking the spans keeps the offsets.
		prose := codeSpanRE.ReplaceAllStringFunc(block, func(span string) string {
			return strings.Repeat(" ", len(span))
		})
		for _, m := range linkRE.FindAllStringSubmatchIndex(prose, -1) {
			if p, ok := linkPath(prose[m[2]:m[3]]); ok {
				target := path.Join(path.Dir(doc), p)
				if strings.HasPrefix(p, "/") {
					target = path.Clean(strings.TrimPrefix(p, "/"))
				}
				refs = append(refs, reference{line: lineAt(m[0]), written: p, target: target})
			}
		}
	}

	var block []string
	blockStart := 0 // 1-based line of block[0]
	flush := func() {
		if len(block) > 0 {
			scan(strings.Join(block, "\n"), blockStart)
		}
		block = nil
	}
	inFence := false
	for i, line := range strings.Split(text, "\n") {
		switch {
		case fenceRE.MatchString(line):
			flush()
			inFence = !inFence
		case inFence:
		case strings.TrimSpace(line) == "":
			flush()
		default:
			if len(block) == 0 {
				blockStart = i + 1
			}
			block = append(block, line)
		}
	}
	flush()
	return refs
}

// linkPath returns a link target's path without its fragment or query, and whether the target is a
// local path at all (not a URL, a mail address or an anchor in the same page).
func linkPath(target string) (string, bool) {
	if strings.HasPrefix(target, "#") || strings.Contains(target, "://") ||
		strings.HasPrefix(target, "mailto:") {
		return "", false
	}
	if i := strings.IndexAny(target, "#?"); i >= 0 {
		target = target[:i]
	}
	return target, target != ""
}

// goSuffixRE matches a trailing ":LINE" or ":Identifier" after a file name.
var goSuffixRE = regexp.MustCompile(`:[A-Za-z0-9_.]+$`)

// codePath returns the path an inline code span names and whether it looks like a repository
// path at all.
func codePath(span string, topDirs map[string]bool) (string, bool) {
	s := strings.TrimSpace(span)
	if s == "" || strings.ContainsAny(s, " \t\n*<{$") || strings.HasPrefix(s, "-") ||
		strings.Contains(s, "://") || strings.HasPrefix(s, "github.com/") {
		return "", false
	}
	s = strings.TrimPrefix(s, "./")
	if !strings.Contains(s, "/") {
		return "", false
	}
	s = goSuffixRE.ReplaceAllString(s, "")
	first, _, _ := strings.Cut(s, "/")
	if topDirs[first] || hasFileExtension(s) {
		return s, true
	}
	return "", false
}

// hasFileExtension reports whether p ends in one of fileExtensions.
func hasFileExtension(p string) bool {
	for _, ext := range fileExtensions {
		if strings.HasSuffix(p, ext) {
			return true
		}
	}
	return false
}

// allowedPath reports whether p, a path from the repository root, is in allowed, itself or under a
// directory entry.
func allowedPath(p string) bool {
	for key := range allowed {
		if p == key || (strings.HasSuffix(key, "/") && strings.HasPrefix(p+"/", key)) {
			return true
		}
	}
	return false
}

// exists reports whether target, a slash-separated path from the repository root, is a file or
// directory. A Go reference to a package member (`server/app.Dispatcher`) counts when the
// package directory exists.
func exists(target string) bool {
	if _, err := os.Stat(filepath.Join(repoRoot, filepath.FromSlash(target))); err == nil {
		return true
	}
	dir, file := path.Split(target)
	if pkg, _, ok := strings.Cut(file, "."); ok && dir != "" {
		if fi, err := os.Stat(filepath.Join(repoRoot, filepath.FromSlash(dir+pkg))); err == nil && fi.IsDir() {
			// Only a member reference (an exported or unexported Go identifier), not a missing file.
			return !hasFileExtension(target)
		}
	}
	return false
}
