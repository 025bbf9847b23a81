// Package deploy checks the container image and the Kubernetes manifests structurally, without a
// cluster or a container runtime: the Dockerfile's build and run stages, every manifest under
// kubernetes/ as kustomize would apply it (base, overlays, and each example on its own), and the
// router's configuration through kvrouter's own loader.
package deploy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"io/fs"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/kvrouter/kvrouter/server/config"
)

const (
	kubeDir     = "kubernetes"
	examplesDir = "kubernetes/examples"

	// Router ports, as docs/operations.md names them.
	grpcPort    = 50051
	healthPort  = 8086
	metricsPort = 9090

	// Liveness checks the whole server (""): a replica whose shared state is being re-established
	// is not ready, but a restart would not help it.
	livenessService  = ""
	readinessService = "kvrouter.v1.RouterService"
	// sharedStateService exists only in Redis mode and turns NOT_SERVING on every replica at once
	// while Redis is unreachable, when routing goes on: no probe may depend on it.
	sharedStateService = "kvrouter.v1.SharedState"

	// indexBytesPerBlock is the index's cost per distinct block (docs/BENCHMARKS.md: 122-128 B).
	indexBytesPerBlock = 128
	// bookedBytesPerBlock is what a booked block key holds live: 8 B in its booking and about
	// 37 B in the load's table (45 B measured, docs/security.md).
	bookedBytesPerBlock = 48

	// podName stands for a router pod's metadata.name where the downward API provides it.
	podName = "kvrouter-5d9c7b8f4-x7k2p"
)

// doc is one YAML document.
type doc = map[string]any

// manifest is one document and the file it came from.
type manifest struct {
	file string
	doc  doc
}

func (m manifest) kind() string { return str(m.doc, "kind") }
func (m manifest) name() string { return str(m.doc, "metadata", "name") }
func (m manifest) String() string {
	return fmt.Sprintf("%s %s/%s", filepath.ToSlash(m.file), m.kind(), m.name())
}

// unit is what one `kubectl apply` creates: a kustomization as kustomize renders it, or one example.
type unit struct {
	name string
	docs []manifest
}

// TestManifests checks every unit: each kustomization under kubernetes/ (rendered here: resources,
// configMapGenerator, strategic-merge patches) and each example file.
func TestManifests(t *testing.T) {
	for _, u := range units(t) {
		t.Run(u.name, func(t *testing.T) { checkUnit(t, u) })
	}
}

// TestKustomizationsListEveryFile: every file a kustomization names exists (units fails
// otherwise), and every manifest outside examples/ is named by some kustomization, so that none is
// silently left out of `kubectl apply -k`.
func TestKustomizationsListEveryFile(t *testing.T) {
	listed := map[string]bool{}
	for _, dir := range kustomizationDirs(t) {
		k := readKustomization(t, dir)
		for _, f := range k.files() {
			listed[filepath.Clean(filepath.Join(dir, f))] = true
		}
	}
	err := filepath.WalkDir(kubeDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !isYAML(path) || filepath.Base(path) == "kustomization.yaml" {
			return err
		}
		if strings.HasPrefix(filepath.ToSlash(path), examplesDir+"/") {
			return nil
		}
		if !listed[filepath.Clean(path)] {
			t.Errorf("%s is named by no kustomization.yaml (resources, patches or configMapGenerator files): kubectl apply -k would leave it out", path)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestRouterConfiguration loads each unit's router configuration (the ConfigMap's file, the
// container's arguments and KVROUTER_* environment) through config.Load, as `kvrouter serve` in the
// pod would, and checks it against the manifests: ports, probes, mounted files, shutdown timing,
// memory, and in Redis mode the Redis address and the replica id. The overlays' configuration files
// must be the base's plus their own keys.
func TestRouterConfiguration(t *testing.T) {
	var base map[string]any
	for _, u := range units(t) {
		if strings.HasPrefix(u.name, "examples/") {
			continue
		}
		t.Run(u.name, func(t *testing.T) {
			file := checkRouter(t, u)
			if u.name == "base" {
				base = file
				return
			}
			if base == nil {
				t.Fatal("the base unit's configuration was not loaded first")
			}
			for key, want := range base {
				if got, ok := file[key]; !ok || !equalYAML(got, want) {
					t.Errorf("config file %s = %v, want the base's %v (keep the overlay's file equal to the base's but for its own settings)", key, got, want)
				}
			}
			for key := range file {
				if _, ok := base[key]; !ok && !strings.HasPrefix(key, "redis_") {
					t.Errorf("config file sets %s, which the base does not: set it in the base, or name the overlay's own settings here", key)
				}
			}
		})
	}
	if base == nil {
		t.Error("no router configuration in the base unit")
	}
}

// TestKustomizeBuild renders every kustomization with kubectl's kustomize, when kubectl is on the
// PATH, and checks what it renders like TestManifests and TestRouterConfiguration do: that the
// rendering here agrees with kustomize's.
func TestKustomizeBuild(t *testing.T) {
	kubectl, err := exec.LookPath("kubectl")
	if err != nil {
		t.Skip("kubectl is not on the PATH: the kustomizations are only checked as rendered by this test")
	}
	for _, dir := range kustomizationDirs(t) {
		name := unitName(dir)
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			out, err := exec.CommandContext(ctx, kubectl, "kustomize", dir).Output()
			if err != nil {
				var ee *exec.ExitError
				if errors.As(err, &ee) {
					t.Fatalf("kubectl kustomize %s: %v\n%s", dir, err, ee.Stderr)
				}
				t.Fatalf("kubectl kustomize %s: %v", dir, err)
			}
			docs, err := decodeDocs(out)
			if err != nil {
				t.Fatalf("kubectl kustomize %s: %v", dir, err)
			}
			u := unit{name: name}
			for _, d := range docs {
				u.docs = append(u.docs, manifest{file: "kustomize:" + dir, doc: d})
			}
			checkUnit(t, u)
			checkRouter(t, u)
		})
	}
}

// TestBridgeSidecar checks every `kvrouter bridge` container of the examples: its settings are keys
// `kvrouter bridge` knows, it has what the bridge requires, it dials the routers with TLS and
// credentials (docs/security.md), and it agrees with the engine container next to it.
func TestBridgeSidecar(t *testing.T) {
	known := bridgeKeys(t)
	found := 0
	for _, u := range units(t) {
		for _, m := range u.docs {
			spec := podSpec(m.doc)
			if spec == nil {
				continue
			}
			for _, c := range list(spec, "containers") {
				c := c.(doc)
				if args := stringList(c, "args"); len(args) == 0 || args[0] != "bridge" {
					continue
				}
				found++
				t.Run(u.name+"/"+str(c, "name"), func(t *testing.T) { checkBridge(t, m, spec, c, known) })
			}
		}
	}
	if found == 0 {
		t.Error("no kvrouter bridge container in any example: examples/vllm-with-bridge.yaml should have one")
	}
}

// TestDockerfile lints ../Dockerfile: a multi-stage build whose images are pinned, a static Go
// build (CGO_ENABLED=0, -trimpath) by go.mod's Go version, a distroless or scratch run stage as a
// numeric non-root user, no ADD of URLs, the binary as an exec-form entry point with serve as its
// command, and an exec-form health check of a binary the run stage holds.
func TestDockerfile(t *testing.T) {
	data, err := os.ReadFile("../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	lintDockerfile(t, string(data), goVersion(t))

	ignore, err := os.ReadFile("../.dockerignore")
	if err != nil {
		t.Fatalf("../.dockerignore: %v (the build context would hold .git and every local build output)", err)
	}
	for _, want := range []string{".git", ".tmp"} {
		if !slices.Contains(strings.Fields(string(ignore)), want) {
			t.Errorf(".dockerignore does not list %s", want)
		}
	}
}

// TestDockerfileLintFails makes sure the lint notices what it is meant to: each case breaks one
// rule of a good Dockerfile.
func TestDockerfileLintFails(t *testing.T) {
	data, err := os.ReadFile("../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	good := string(data)
	gov := goVersion(t)
	for _, tc := range []struct{ name, old, new string }{
		{"latest base", "gcr.io/distroless/static-debian12:nonroot", "gcr.io/distroless/static-debian12:latest"},
		{"untagged builder", "FROM golang:" + gov + " AS build", "FROM golang AS build"},
		{"root user", "USER 65532:65532", "USER root"},
		{"shell entry point", `ENTRYPOINT ["/kvrouter"]`, "ENTRYPOINT /kvrouter"},
		{"cgo", "ENV CGO_ENABLED=0", "ENV CGO_ENABLED=1"},
		{"no trimpath", "go build -trimpath", "go build"},
		{"ADD of a URL", "COPY . .", "ADD https://example.com/src.tar.gz ."},
		{"unpinned probe", "grpc-health-probe@v", "grpc-health-probe@latest #"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !strings.Contains(good, tc.old) {
				t.Fatalf("the Dockerfile no longer contains %q: update this case", tc.old)
			}
			rec := &recorder{}
			lintDockerfile(rec, strings.Replace(good, tc.old, tc.new, 1), gov)
			if len(rec.errs) == 0 {
				t.Errorf("the lint passed a Dockerfile with %q replaced by %q", tc.old, tc.new)
			}
			for _, e := range rec.errs {
				t.Log(e)
			}
		})
	}
}

// --- loading ---------------------------------------------------------------------------------

func isYAML(path string) bool {
	return strings.HasSuffix(path, ".yaml") || strings.HasSuffix(path, ".yml")
}

func decodeDocs(data []byte) ([]doc, error) {
	var out []doc
	dec := yaml.NewDecoder(bytes.NewReader(data))
	for {
		var d doc
		err := dec.Decode(&d)
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		if d != nil { // an empty document (a trailing ---)
			out = append(out, d)
		}
	}
}

func readDocs(t *testing.T, path string) []manifest {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	docs, err := decodeDocs(data)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	if len(docs) == 0 {
		t.Errorf("%s holds no YAML document", path)
	}
	out := make([]manifest, len(docs))
	for i, d := range docs {
		out[i] = manifest{file: path, doc: d}
	}
	return out
}

// kustomization is the part of a kustomization.yaml this test renders.
type kustomization struct {
	Resources []string `yaml:"resources"`
	Patches   []struct {
		Path   string `yaml:"path"`
		Target *struct {
			Kind string `yaml:"kind"`
			Name string `yaml:"name"`
		} `yaml:"target"`
	} `yaml:"patches"`
	ConfigMapGenerator []struct {
		Name     string   `yaml:"name"`
		Behavior string   `yaml:"behavior"`
		Files    []string `yaml:"files"`
	} `yaml:"configMapGenerator"`
	Rest map[string]any `yaml:",inline"`
}

// files lists every path the kustomization names, relative to its directory.
func (k kustomization) files() []string {
	out := slices.Clone(k.Resources)
	for _, p := range k.Patches {
		out = append(out, p.Path)
	}
	for _, g := range k.ConfigMapGenerator {
		out = append(out, g.Files...)
	}
	return out
}

func readKustomization(t *testing.T, dir string) kustomization {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k kustomization
	if err := yaml.Unmarshal(data, &k); err != nil {
		t.Fatalf("%s/kustomization.yaml: %v", dir, err)
	}
	// Fields this test does not render would make its rendering differ from kustomize's.
	for key := range k.Rest {
		switch key {
		case "apiVersion", "kind":
		default:
			t.Errorf("%s/kustomization.yaml: %s is not rendered by this test: render it in renderKustomization, or do without", dir, key)
		}
	}
	for _, f := range k.files() {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Errorf("%s/kustomization.yaml names %s: %v", dir, f, err)
		}
	}
	return k
}

func kustomizationDirs(t *testing.T) []string {
	t.Helper()
	var dirs []string
	err := filepath.WalkDir(kubeDir, func(path string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && d.Name() == "kustomization.yaml" {
			dirs = append(dirs, filepath.Dir(path))
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(dirs) == 0 {
		t.Fatalf("no kustomization.yaml under %s", kubeDir)
	}
	slices.Sort(dirs) // base before overlays
	return dirs
}

func unitName(dir string) string {
	rel, _ := filepath.Rel(kubeDir, dir)
	return filepath.ToSlash(rel)
}

// units renders every kustomization and reads every example.
func units(t *testing.T) []unit {
	t.Helper()
	var out []unit
	for _, dir := range kustomizationDirs(t) {
		out = append(out, unit{name: unitName(dir), docs: renderKustomization(t, dir)})
	}
	examples, err := filepath.Glob(filepath.Join(examplesDir, "*"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range examples {
		if isYAML(f) {
			out = append(out, unit{name: "examples/" + filepath.Base(f), docs: readDocs(t, f)})
		}
	}
	return out
}

// renderKustomization renders what this repository's kustomizations use: resources (files and
// directories), configMapGenerator files (create, replace, merge; without the name's hash suffix)
// and strategic-merge patches of named lists.
func renderKustomization(t *testing.T, dir string) []manifest {
	t.Helper()
	k := readKustomization(t, dir)
	var docs []manifest
	for _, r := range k.Resources {
		p := filepath.Join(dir, r)
		if st, err := os.Stat(p); err == nil && st.IsDir() {
			docs = append(docs, renderKustomization(t, p)...)
		} else if err == nil {
			docs = append(docs, readDocs(t, p)...)
		}
	}
	for _, g := range k.ConfigMapGenerator {
		data := map[string]any{}
		for _, f := range g.Files {
			b, err := os.ReadFile(filepath.Join(dir, f))
			if err != nil {
				continue // reported by readKustomization
			}
			data[filepath.Base(f)] = string(b)
		}
		i := slices.IndexFunc(docs, func(m manifest) bool { return m.kind() == "ConfigMap" && m.name() == g.Name })
		switch g.Behavior {
		case "", "create":
			if i >= 0 {
				t.Errorf("%s: configMapGenerator %s exists already: use behavior replace or merge", dir, g.Name)
			}
			docs = append(docs, manifest{file: filepath.Join(dir, "kustomization.yaml"), doc: doc{
				"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc{"name": g.Name}, "data": data}})
		case "replace", "merge":
			if i < 0 {
				t.Errorf("%s: configMapGenerator %s (behavior %s) has no ConfigMap to change", dir, g.Name, g.Behavior)
				continue
			}
			cm := clone(docs[i].doc).(doc)
			if g.Behavior == "merge" {
				maps.Copy(cm["data"].(map[string]any), data)
			} else {
				cm["data"] = data
			}
			docs[i] = manifest{file: filepath.Join(dir, "kustomization.yaml"), doc: cm}
		default:
			t.Errorf("%s: configMapGenerator %s: unknown behavior %q", dir, g.Name, g.Behavior)
		}
	}
	for _, p := range k.Patches {
		path := filepath.Join(dir, p.Path)
		if _, err := os.Stat(path); err != nil {
			continue // reported by readKustomization
		}
		for _, patch := range readDocs(t, path) {
			kind, name := patch.kind(), patch.name()
			if p.Target != nil {
				kind, name = p.Target.Kind, p.Target.Name
			}
			i := slices.IndexFunc(docs, func(m manifest) bool { return m.kind() == kind && m.name() == name })
			if i < 0 {
				t.Errorf("%s: patch %s targets %s/%s, which the kustomization does not hold", dir, p.Path, kind, name)
				continue
			}
			docs[i] = manifest{file: docs[i].file + " + " + path, doc: strategicMerge(clone(docs[i].doc), patch.doc, "").(doc)}
		}
	}
	return docs
}

// mergeKeys are the keys by which a strategic-merge patch merges the elements of these lists (as
// Kubernetes' API declares them); any other list is replaced.
var mergeKeys = map[string]string{
	"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
	"volumeMounts": "mountPath", "imagePullSecrets": "name",
	// A container's ports; a Service's merge by "port", and no patch here patches a Service.
	"ports": "containerPort",
}

func strategicMerge(dst, patch any, field string) any {
	switch p := patch.(type) {
	case doc:
		d, ok := dst.(doc)
		if !ok {
			return p
		}
		for k, v := range p {
			if v == nil {
				delete(d, k)
				continue
			}
			d[k] = strategicMerge(d[k], v, k)
		}
		return d
	case []any:
		key, ok := mergeKeys[field]
		d, isList := dst.([]any)
		if !ok || !isList {
			return p
		}
		for _, e := range p {
			pe, _ := e.(doc)
			i := slices.IndexFunc(d, func(x any) bool { xe, _ := x.(doc); return xe != nil && pe != nil && xe[key] == pe[key] })
			if i >= 0 {
				d[i] = strategicMerge(d[i], e, "")
			} else {
				d = append(d, e)
			}
		}
		return d
	}
	return patch
}

func clone(v any) any {
	switch v := v.(type) {
	case doc:
		out := make(doc, len(v))
		for k, e := range v {
			out[k] = clone(e)
		}
		return out
	case []any:
		out := make([]any, len(v))
		for i, e := range v {
			out[i] = clone(e)
		}
		return out
	}
	return v
}

// --- accessors ---------------------------------------------------------------------------------

func get(v any, path ...string) any {
	for _, p := range path {
		m, ok := v.(doc)
		if !ok {
			return nil
		}
		v = m[p]
	}
	return v
}

func str(v any, path ...string) string  { s, _ := get(v, path...).(string); return s }
func list(v any, path ...string) []any  { l, _ := get(v, path...).([]any); return l }
func mapping(v any, path ...string) doc { m, _ := get(v, path...).(doc); return m }

func stringList(v any, path ...string) []string {
	var out []string
	for _, e := range list(v, path...) {
		out = append(out, fmt.Sprint(e))
	}
	return out
}

func labels(v any, path ...string) map[string]string {
	out := map[string]string{}
	for k, e := range mapping(v, path...) {
		out[k] = fmt.Sprint(e)
	}
	return out
}

func equalYAML(a, b any) bool { return fmt.Sprint(a) == fmt.Sprint(b) }

// podSpec returns a workload's pod spec, nil for anything else.
func podSpec(d doc) doc {
	switch str(d, "kind") {
	case "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job":
		return mapping(d, "spec", "template", "spec")
	}
	return nil
}

// selects reports whether every label of the selector is among the pod's labels.
func selects(selector, pod map[string]string) bool {
	if len(selector) == 0 {
		return false
	}
	for k, v := range selector {
		if pod[k] != v {
			return false
		}
	}
	return true
}

// selected lists the workloads of u whose pods the selector selects.
func selected(u unit, selector map[string]string) []manifest {
	var out []manifest
	for _, m := range u.docs {
		if podSpec(m.doc) != nil && selects(selector, labels(m.doc, "spec", "template", "metadata", "labels")) {
			out = append(out, m)
		}
	}
	return out
}

// --- generic checks ----------------------------------------------------------------------------

func checkUnit(t *testing.T, u unit) {
	t.Helper()
	if len(u.docs) == 0 {
		t.Fatal("no documents")
	}
	seen := map[string]string{}
	for _, m := range u.docs {
		for _, f := range [][]string{{"apiVersion"}, {"kind"}, {"metadata", "name"}} {
			if str(m.doc, f...) == "" {
				t.Errorf("%s: %s is missing", m, strings.Join(f, "."))
			}
		}
		id := m.kind() + "/" + m.name()
		if prev, dup := seen[id]; dup {
			t.Errorf("%s: %s is also defined in %s", m, id, prev)
		}
		seen[id] = m.file
		switch m.kind() {
		case "Deployment", "StatefulSet", "DaemonSet":
			checkWorkload(t, u, m)
		case "Service":
			checkService(t, u, m)
		case "PodDisruptionBudget":
			sel := labels(m.doc, "spec", "selector", "matchLabels")
			if got := selected(u, sel); len(got) != 1 {
				t.Errorf("%s: selector %v selects %d workloads (%v), want one", m, sel, len(got), got)
			}
			if get(m.doc, "spec", "minAvailable") == nil && get(m.doc, "spec", "maxUnavailable") == nil {
				t.Errorf("%s: sets neither minAvailable nor maxUnavailable", m)
			}
		case "NetworkPolicy":
			sel := labels(m.doc, "spec", "podSelector", "matchLabels")
			if got := selected(u, sel); len(got) != 1 {
				t.Errorf("%s: podSelector %v selects %d workloads, want one", m, sel, len(got))
			}
			for _, rule := range list(m.doc, "spec", "ingress") {
				for _, from := range list(rule, "from") {
					if sel := labels(from, "podSelector", "matchLabels"); len(sel) > 0 && len(selected(u, sel)) == 0 {
						t.Errorf("%s: ingress from podSelector %v selects no workload", m, sel)
					}
				}
			}
		}
	}
}

// imageRef splits an image reference into its repository, tag and digest.
func imageRef(image string) (repo, tag, digest string) {
	repo = image
	if i := strings.Index(repo, "@"); i >= 0 {
		repo, digest = repo[:i], repo[i+1:]
	}
	if i := strings.LastIndex(repo, ":"); i > strings.LastIndex(repo, "/") {
		repo, tag = repo[:i], repo[i+1:]
	}
	return repo, tag, digest
}

func checkWorkload(t *testing.T, u unit, m manifest) {
	t.Helper()
	sel := labels(m.doc, "spec", "selector", "matchLabels")
	podLabels := labels(m.doc, "spec", "template", "metadata", "labels")
	if !selects(sel, podLabels) {
		t.Errorf("%s: selector %v does not match its pod template's labels %v", m, sel, podLabels)
	}
	spec := podSpec(m.doc)
	volumes := map[string]doc{}
	for _, v := range list(spec, "volumes") {
		volumes[str(v, "name")] = v.(doc)
	}
	for _, c := range list(m.doc, "spec", "volumeClaimTemplates") {
		volumes[str(c, "metadata", "name")] = doc{"persistentVolumeClaim": doc{}}
	}
	if m.kind() == "StatefulSet" {
		svc := str(m.doc, "spec", "serviceName")
		i := slices.IndexFunc(u.docs, func(s manifest) bool { return s.kind() == "Service" && s.name() == svc })
		if i < 0 || str(u.docs[i].doc, "spec", "clusterIP") != "None" || !selects(labels(u.docs[i].doc, "spec", "selector"), podLabels) {
			t.Errorf("%s: serviceName %q names no headless Service selecting its pods", m, svc)
		}
	}
	containers := list(spec, "containers")
	if len(containers) == 0 {
		t.Errorf("%s: no containers", m)
	}
	for _, c := range containers {
		c := c.(doc)
		where := fmt.Sprintf("%s container %s", m, str(c, "name"))
		image := str(c, "image")
		if _, tag, digest := imageRef(image); image == "" {
			t.Errorf("%s: no image", where)
		} else if tag == "latest" || (tag == "" && digest == "") {
			t.Errorf("%s: image %s must be pinned to a version (a tag other than latest, or a digest)", where, image)
		}
		sc := func(key string) any {
			if v := get(c, "securityContext", key); v != nil {
				return v
			}
			return get(spec, "securityContext", key)
		}
		if sc("runAsNonRoot") != true {
			t.Errorf("%s: runAsNonRoot is not true (in the container's or the pod's securityContext)", where)
		}
		if get(c, "securityContext", "allowPrivilegeEscalation") != false {
			t.Errorf("%s: securityContext.allowPrivilegeEscalation is not false", where)
		}
		if !slices.Contains(stringList(c, "securityContext", "capabilities", "drop"), "ALL") {
			t.Errorf("%s: securityContext.capabilities.drop does not hold ALL", where)
		}
		if repo, _, _ := imageRef(image); repo == "kvrouter" || strings.HasSuffix(repo, "/kvrouter") {
			if get(c, "securityContext", "readOnlyRootFilesystem") != true {
				t.Errorf("%s: kvrouter writes nothing to its filesystem: set readOnlyRootFilesystem", where)
			}
		}
		for _, r := range []string{"cpu", "memory"} {
			if get(c, "resources", "requests", r) == nil {
				t.Errorf("%s: resources.requests.%s is not set", where, r)
			}
		}
		if get(c, "resources", "limits", "memory") == nil {
			t.Errorf("%s: resources.limits.memory is not set", where)
		}
		ports := map[string]int{}
		numbers := map[int]bool{}
		for _, p := range list(c, "ports") {
			n, _ := get(p, "containerPort").(int)
			ports[str(p, "name")] = n
			numbers[n] = true
		}
		for _, probe := range []string{"startupProbe", "livenessProbe", "readinessProbe"} {
			pr := mapping(c, probe)
			if pr == nil {
				continue
			}
			for _, action := range []string{"grpc", "httpGet", "tcpSocket"} {
				port := get(pr, action, "port")
				switch p := port.(type) {
				case nil:
				case int:
					if !numbers[p] {
						t.Errorf("%s: %s %s port %d is no containerPort of the container", where, probe, action, p)
					}
				case string:
					if action == "grpc" {
						t.Errorf("%s: %s grpc port %q: a gRPC probe's port is a number (Kubernetes has no named ports for it)", where, probe, p)
					} else if _, ok := ports[p]; !ok {
						t.Errorf("%s: %s %s port %q names no port of the container", where, probe, action, p)
					}
				}
			}
			if svc := str(pr, "grpc", "service"); svc == sharedStateService {
				t.Errorf("%s: %s checks %s, which embedded mode lacks and a Redis outage turns NOT_SERVING on every replica at once while routing goes on (docs/operations.md, \"Readiness\"): check %s", where, probe, svc, readinessService)
			}
		}
		for _, vm := range list(c, "volumeMounts") {
			v, ok := volumes[str(vm, "name")]
			if !ok {
				t.Errorf("%s: volumeMount %s names no volume of the pod", where, str(vm, "name"))
				continue
			}
			if (v["secret"] != nil || v["configMap"] != nil) && str(vm, "subPath") != "" {
				t.Errorf("%s: volumeMount %s uses subPath, so a changed Secret or ConfigMap never reaches the container: mount the whole volume", where, str(vm, "name"))
			}
		}
	}
	for name, v := range volumes {
		if cm := str(v, "configMap", "name"); cm != "" && !slices.ContainsFunc(u.docs, func(d manifest) bool { return d.kind() == "ConfigMap" && d.name() == cm }) {
			t.Errorf("%s: volume %s mounts ConfigMap %s, which the unit does not hold", m, name, cm)
		}
	}
}

func checkService(t *testing.T, u unit, m manifest) {
	t.Helper()
	sel := labels(m.doc, "spec", "selector")
	got := selected(u, sel)
	if len(got) != 1 {
		t.Errorf("%s: selector %v selects %d workloads (%v), want one", m, sel, len(got), got)
		return
	}
	names, numbers := map[string]bool{}, map[int]bool{}
	for _, c := range list(podSpec(got[0].doc), "containers") {
		for _, p := range list(c, "ports") {
			names[str(p, "name")] = true
			n, _ := get(p, "containerPort").(int)
			numbers[n] = true
		}
	}
	for _, p := range list(m.doc, "spec", "ports") {
		target := get(p, "targetPort")
		if target == nil {
			target = get(p, "port")
		}
		switch tp := target.(type) {
		case int:
			if !numbers[tp] {
				t.Errorf("%s: port %s targets %d, no containerPort of %s", m, str(p, "name"), tp, got[0])
			}
		case string:
			if !names[tp] {
				t.Errorf("%s: port %s targets %q, which names no port of %s", m, str(p, "name"), tp, got[0])
			}
		}
	}
}

// --- the router --------------------------------------------------------------------------------

// routerContainer finds the Deployment whose container runs `kvrouter serve`.
func routerContainer(u unit) (manifest, doc, bool) {
	for _, m := range u.docs {
		if m.kind() != "Deployment" {
			continue
		}
		for _, c := range list(podSpec(m.doc), "containers") {
			if args := stringList(c, "args"); len(args) > 0 && args[0] == "serve" {
				return m, c.(doc), true
			}
		}
	}
	return manifest{}, nil, false
}

// fakeEnv is the container's environment as the kubelet would set it, with stand-ins for what
// the downward API and Secrets provide.
func fakeEnv(c doc) map[string]string {
	env := map[string]string{}
	for _, e := range list(c, "env") {
		v := str(e, "value")
		switch {
		case str(e, "valueFrom", "fieldRef", "fieldPath") == "metadata.name":
			v = podName
		case str(e, "valueFrom", "fieldRef", "fieldPath") == "status.podIP":
			v = "10.1.2.3"
		case str(e, "valueFrom", "fieldRef", "fieldPath") != "":
			v = "7"
		case get(e, "valueFrom", "resourceFieldRef") != nil:
			v = "4294967296"
		case get(e, "valueFrom") != nil:
			v = "from-a-secret"
		}
		env[str(e, "name")] = v
	}
	return env
}

// flagValue returns the value of --name (or -name) in args, in either of the flag package's forms.
func flagValue(args []string, name string) (value string, index int, ok bool) {
	for i, a := range args {
		f := strings.TrimLeft(a, "-")
		if f == a {
			continue
		}
		if f == name && i+1 < len(args) {
			return args[i+1], i + 1, true
		}
		if v, found := strings.CutPrefix(f, name+"="); found {
			return v, i, true
		}
	}
	return "", 0, false
}

// mountedFile reports the volume a file path of the container lies in.
func mountedFile(spec, c doc, path string) (volume doc, key string, ok bool) {
	for _, vm := range list(c, "volumeMounts") {
		dir := strings.TrimSuffix(str(vm, "mountPath"), "/") + "/"
		if rest, found := strings.CutPrefix(path, dir); found {
			for _, v := range list(spec, "volumes") {
				if str(v, "name") == str(vm, "name") {
					return v.(doc), rest, true
				}
			}
		}
	}
	return nil, "", false
}

func port(t *testing.T, setting, addr string) int {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	n, err2 := strconv.Atoi(p)
	if err != nil || err2 != nil {
		t.Errorf("%s %q: not host:port", setting, addr)
	}
	return n
}

// checkRouter checks the unit's router Deployment (the unit must have one) and loads its
// configuration; it returns the settings of its configuration file.
func checkRouter(t *testing.T, u unit) map[string]any {
	t.Helper()
	m, c, ok := routerContainer(u)
	if !ok {
		t.Fatal("no Deployment runs kvrouter serve")
	}
	spec := podSpec(m.doc)
	if r := get(m.doc, "spec", "replicas"); r != 3 {
		t.Errorf("%s: replicas %v, want 3", m, r)
	}
	ports := map[string]int{}
	for _, p := range list(c, "ports") {
		ports[str(p, "name")], _ = get(p, "containerPort").(int)
	}
	for name, want := range map[string]int{"grpc": grpcPort, "health": healthPort, "metrics": metricsPort} {
		if ports[name] != want {
			t.Errorf("%s: containerPort %s is %d, want %d", m, name, ports[name], want)
		}
	}
	for probe, service := range map[string]string{"livenessProbe": livenessService, "readinessProbe": readinessService} {
		if got := get(c, probe, "grpc", "port"); got != healthPort {
			t.Errorf("%s: %s is not a gRPC probe of the health port %d (got port %v): the main port serves TLS, which the kubelet's gRPC probes cannot speak", m, probe, healthPort, got)
		}
		if got := str(c, probe, "grpc", "service"); got != service {
			t.Errorf("%s: %s checks service %q, want %q", m, probe, got, service)
		}
	}

	// The configuration, as the process in the pod would load it.
	args := stringList(c, "args")[1:]
	path, i, ok := flagValue(args, "config")
	if !ok {
		t.Fatalf("%s: no --config in the arguments %v", m, args)
	}
	vol, key, ok := mountedFile(spec, c, path)
	cmName := str(vol, "configMap", "name")
	if !ok || cmName == "" {
		t.Fatalf("%s: --config %s lies in no mounted ConfigMap", m, path)
	}
	ci := slices.IndexFunc(u.docs, func(d manifest) bool { return d.kind() == "ConfigMap" && d.name() == cmName })
	if ci < 0 {
		t.Fatalf("%s: ConfigMap %s (of --config %s) is not in the unit", m, cmName, path)
	}
	content, ok := get(u.docs[ci].doc, "data", key).(string)
	if !ok {
		t.Fatalf("%s: ConfigMap %s has no key %s (--config %s)", m, cmName, key, path)
	}
	tmp := filepath.Join(t.TempDir(), key)
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if strings.HasPrefix(args[i], "-") {
		args[i] = "--config=" + tmp
	} else {
		args[i] = tmp
	}
	env := fakeEnv(c)
	var stderr bytes.Buffer
	// Load validates the settings; it reads none of the files they name (TLS, credentials, the
	// Redis password), which exist only in the pod.
	cfg, err := config.Load("kvrouter serve", args, func(k string) string { return env[k] }, &stderr)
	if err != nil {
		t.Fatalf("%s: kvrouter serve would refuse its configuration (%s, --config %s): %v\n%s", m, strings.Join(args, " "), cmName+"/"+key, err, stderr.String())
	}
	var file map[string]any
	if err := yaml.Unmarshal([]byte(content), &file); err != nil {
		t.Fatal(err)
	}

	for setting, want := range map[string]int{"listen": grpcPort, "health_listen": healthPort, "metrics_listen": metricsPort} {
		addr := map[string]string{"listen": cfg.Listen, "health_listen": cfg.HealthListen, "metrics_listen": cfg.MetricsListen}[setting]
		if host, _, _ := net.SplitHostPort(addr); host != "" || port(t, setting, addr) != want {
			t.Errorf("%s: %s is %q, want \":%d\" (every interface: the kubelet and the Services reach the pod's IP)", m, setting, addr, want)
		}
	}
	if cfg.Plaintext || cfg.TLSCertFile == "" {
		t.Errorf("%s: the gRPC port must serve TLS (tls_cert_file %q, plaintext %v)", m, cfg.TLSCertFile, cfg.Plaintext)
	}
	if cfg.CredentialsFile == "" {
		t.Errorf("%s: no credentials_file: every caller reaching the port could call everything", m)
	}
	if cfg.Pprof {
		t.Errorf("%s: pprof is on: the profiler answers without authentication and costs CPU; turn it on by hand, behind kubectl port-forward, when profiling", m)
	}
	for setting, f := range map[string]string{"tls_cert_file": cfg.TLSCertFile, "tls_key_file": cfg.TLSKeyFile,
		"tls_client_ca_file": cfg.TLSClientCAFile, "credentials_file": cfg.CredentialsFile, "redis_password_file": cfg.RedisPasswordFile} {
		if f == "" {
			continue
		}
		if v, _, ok := mountedFile(spec, c, f); !ok || str(v, "secret", "secretName") == "" {
			t.Errorf("%s: %s %s lies in no mounted Secret", m, setting, f)
		}
	}
	grace, _ := get(spec, "terminationGracePeriodSeconds").(int)
	if need := cfg.ShutdownDrain + cfg.ShutdownTimeout; time.Duration(grace)*time.Second <= need {
		t.Errorf("%s: terminationGracePeriodSeconds %d does not exceed shutdown_drain + shutdown_timeout (%v): the kubelet would kill kvrouter mid-shutdown", m, grace, need)
	}
	podLabels := labels(m.doc, "spec", "template", "metadata", "labels")
	spread := slices.ContainsFunc(list(spec, "topologySpreadConstraints"), func(c any) bool {
		return str(c, "topologyKey") == "kubernetes.io/hostname" && selects(labels(c, "labelSelector", "matchLabels"), podLabels)
	})
	for _, kind := range []string{"requiredDuringSchedulingIgnoredDuringExecution", "preferredDuringSchedulingIgnoredDuringExecution"} {
		for _, term := range list(spec, "affinity", "podAntiAffinity", kind) {
			if pt := mapping(term, "podAffinityTerm"); pt != nil {
				term = pt
			}
			spread = spread || (str(term, "topologyKey") == "kubernetes.io/hostname" && selects(labels(term, "labelSelector", "matchLabels"), podLabels))
		}
	}
	if !spread {
		t.Errorf("%s: replicas are not spread over nodes (topologySpreadConstraints or podAntiAffinity on kubernetes.io/hostname)", m)
	}
	if limit, err := quantity(str(c, "resources", "limits", "memory")); err != nil {
		t.Errorf("%s: memory limit: %v", m, err)
	} else if cfg.MaxIndexBlocks == 0 || int64(cfg.MaxIndexBlocks)*indexBytesPerBlock+int64(cfg.MaxBookedBlocks)*bookedBytesPerBlock > limit/2 {
		t.Errorf("%s: max_index_blocks %d (about %d B each) and max_booked_blocks %d (about %d B each) may take more than half the memory limit %s, and a replica loading a snapshot holds two copies of its state",
			m, cfg.MaxIndexBlocks, indexBytesPerBlock, cfg.MaxBookedBlocks, bookedBytesPerBlock, str(c, "resources", "limits", "memory"))
	}

	// The Services and the disruption budget.
	var headless, clusterIP, pdb bool
	for _, d := range u.docs {
		switch {
		case d.kind() == "Service" && selects(labels(d.doc, "spec", "selector"), podLabels):
			hasGRPC := slices.ContainsFunc(list(d.doc, "spec", "ports"), func(p any) bool { return get(p, "port") == grpcPort })
			if str(d.doc, "spec", "clusterIP") == "None" {
				headless = headless || hasGRPC
			} else {
				clusterIP = clusterIP || hasGRPC
			}
			if slices.ContainsFunc(list(d.doc, "spec", "ports"), func(p any) bool { return get(p, "targetPort") == "health" || get(p, "port") == healthPort }) {
				t.Errorf("%s exposes the health port: only the kubelet needs it", d)
			}
		case d.kind() == "PodDisruptionBudget" && selects(labels(d.doc, "spec", "selector", "matchLabels"), podLabels):
			pdb = true
		}
	}
	if !headless {
		t.Errorf("no headless Service (clusterIP: None) with the gRPC port %d selects the router: clients balancing with dns:/// need one", grpcPort)
	}
	if !clusterIP {
		t.Errorf("no ClusterIP Service with the gRPC port %d selects the router", grpcPort)
	}
	if !pdb {
		t.Error("no PodDisruptionBudget selects the router")
	}

	if cfg.RedisAddr != "" || cfg.RedisClusterAddrs != "" {
		checkRedisMode(t, u, m, c, cfg)
	}
	return file
}

// checkRedisMode: the router names its pod as its replica id, and reaches the unit's Redis
// StatefulSet, which keeps an append-only file on a persistent volume.
func checkRedisMode(t *testing.T, u unit, m manifest, c doc, cfg *config.Options) {
	t.Helper()
	if cfg.ReplicaID != podName {
		t.Errorf("%s: replica_id is %q, want the pod's name (KVROUTER_REPLICA_ID from the downward API's metadata.name)", m, cfg.ReplicaID)
	}
	host, p, err := net.SplitHostPort(cfg.RedisAddr)
	if err != nil {
		t.Fatalf("%s: redis_addr %q: %v", m, cfg.RedisAddr, err)
	}
	labelsOfHost := strings.Split(host, ".")
	var sts manifest
	for _, d := range u.docs {
		if d.kind() == "StatefulSet" && len(labelsOfHost) >= 2 && labelsOfHost[0] == d.name()+"-0" && labelsOfHost[1] == str(d.doc, "spec", "serviceName") {
			sts = d
		}
	}
	if sts.doc == nil {
		t.Fatalf("%s: redis_addr %s names no StatefulSet's first pod through its Service (<statefulset>-0.<serviceName>)", m, cfg.RedisAddr)
	}
	for _, rc := range list(podSpec(sts.doc), "containers") {
		if !slices.ContainsFunc(list(rc, "ports"), func(cp any) bool { return fmt.Sprint(get(cp, "containerPort")) == p }) {
			t.Errorf("%s: redis_addr port %s is no containerPort of %s", m, p, sts)
		}
		cmd := strings.Join(append(stringList(rc, "command"), stringList(rc, "args")...), " ")
		cmd = regexp.MustCompile(`\s+`).ReplaceAllString(cmd, " ")
		for _, want := range []string{"--appendonly yes", "--appendfsync everysec"} {
			if !strings.Contains(cmd, want) {
				t.Errorf("%s: Redis runs without %s (docs/operations.md: a Redis that restarts empty loses the shared log): %s", sts, want, cmd)
			}
		}
		dataDir := "/data" // the official image's
		if dir, _, ok := flagValue(strings.Fields(cmd), "dir"); ok {
			dataDir = dir
		}
		persistent := slices.ContainsFunc(list(rc, "volumeMounts"), func(vm any) bool {
			return str(vm, "mountPath") == dataDir && slices.ContainsFunc(list(sts.doc, "spec", "volumeClaimTemplates"), func(v any) bool {
				return str(v, "metadata", "name") == str(vm, "name")
			})
		})
		if !persistent {
			t.Errorf("%s: Redis's directory %s is not a volume from volumeClaimTemplates: its append-only file would not survive the pod", sts, dataDir)
		}
	}
}

// quantity parses a Kubernetes memory quantity (4Gi, 512Mi, 1G, 1000).
func quantity(q string) (int64, error) {
	units := []struct {
		suffix string
		mult   int64
	}{{"Ki", 1 << 10}, {"Mi", 1 << 20}, {"Gi", 1 << 30}, {"Ti", 1 << 40}, {"k", 1e3}, {"M", 1e6}, {"G", 1e9}, {"T", 1e12}}
	for _, u := range units {
		if n, ok := strings.CutSuffix(q, u.suffix); ok {
			v, err := strconv.ParseInt(n, 10, 64)
			return v * u.mult, err
		}
	}
	return strconv.ParseInt(q, 10, 64)
}

// --- the bridge --------------------------------------------------------------------------------

// bridgeKeys lists the settings of `kvrouter bridge`, read from the source that defines them
// (cmd/kvrouter/bridge.go, bridgeSettings: a layered.X("key", ...) call each).
func bridgeKeys(t *testing.T) map[string]bool {
	t.Helper()
	const src = "../cmd/kvrouter/bridge.go"
	f, err := parser.ParseFile(token.NewFileSet(), src, nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]bool{}
	ast.Inspect(f, func(n ast.Node) bool {
		vs, ok := n.(*ast.ValueSpec)
		if !ok || len(vs.Names) != 1 || vs.Names[0].Name != "bridgeSettings" || len(vs.Values) != 1 {
			return true
		}
		for _, e := range vs.Values[0].(*ast.CompositeLit).Elts {
			if call, ok := e.(*ast.CallExpr); ok && len(call.Args) > 0 {
				if lit, ok := call.Args[0].(*ast.BasicLit); ok && lit.Kind == token.STRING {
					k, _ := strconv.Unquote(lit.Value)
					keys[k] = true
				}
			}
		}
		return false
	})
	if len(keys) < 10 || !keys["router_addrs"] {
		t.Fatalf("%s: found %d bridge settings in bridgeSettings (%v): did its shape change?", src, len(keys), slices.Sorted(maps.Keys(keys)))
	}
	return keys
}

func checkBridge(t *testing.T, m manifest, spec, c doc, known map[string]bool) {
	t.Helper()
	settings := map[string]string{}
	args := stringList(c, "args")[1:]
	for i := 0; i < len(args); i++ {
		f, found := strings.CutPrefix(args[i], "--")
		if !found {
			t.Errorf("%s: argument %q is not a --flag", m, args[i])
			continue
		}
		key, value, hasValue := strings.Cut(f, "=")
		key = strings.ReplaceAll(key, "-", "_")
		if !hasValue && i+1 < len(args) && !strings.HasPrefix(args[i+1], "-") {
			i++
			value = args[i]
		}
		settings[key] = value
	}
	for name, v := range fakeEnv(c) {
		if key, ok := strings.CutPrefix(name, "KVROUTER_"); ok {
			settings[strings.ToLower(key)] = v
		}
	}
	for key := range settings {
		if !known[key] {
			t.Errorf("%s: kvrouter bridge has no setting %s (flag --%s, or KVROUTER_%s)", m, key, strings.ReplaceAll(key, "_", "-"), strings.ToUpper(key))
		}
	}
	for _, key := range []string{"router_addrs", "worker_id", "model", "block_size", "total_kv_blocks", "engine_endpoint", "worker_endpoint"} {
		if settings[key] == "" {
			t.Errorf("%s: kvrouter bridge needs %s", m, key)
		}
	}
	// The routers serve TLS and check credentials (docs/security.md): the bridge verifies them
	// and brings a credential, a client certificate or a bearer token.
	if _, ok := settings["router_plaintext"]; ok {
		t.Errorf("%s: router_plaintext: the routers serve TLS", m)
	}
	if settings["router_ca_file"] == "" {
		t.Errorf("%s: no router_ca_file: the bridge would not verify the routers' certificates", m)
	}
	cert := settings["router_cert_file"] != "" && settings["router_key_file"] != ""
	if !cert && settings["router_token_file"] == "" {
		t.Errorf("%s: no credential for the routers: router_cert_file and router_key_file, or router_token_file", m)
	}
	for _, key := range []string{"router_ca_file", "router_cert_file", "router_key_file", "router_token_file"} {
		if f := settings[key]; f != "" {
			if v, _, ok := mountedFile(spec, c, f); !ok || str(v, "secret", "secretName") == "" {
				t.Errorf("%s: %s %s lies in no mounted Secret", m, key, f)
			}
		}
	}
	if !strings.HasPrefix(settings["engine_endpoint"], "tcp://127.0.0.1:") {
		t.Errorf("%s: engine_endpoint %q: a sidecar reaches its engine on localhost", m, settings["engine_endpoint"])
	}

	// The engine next to it: vLLM's block size and KV event endpoints.
	for _, e := range list(spec, "containers") {
		args := stringList(e, "args")
		events, _, ok := flagValue(args, "kv-events-config")
		if !ok {
			continue
		}
		var kv struct {
			Enable         bool   `json:"enable_kv_cache_events"`
			Endpoint       string `json:"endpoint"`
			ReplayEndpoint string `json:"replay_endpoint"`
		}
		if err := json.Unmarshal([]byte(events), &kv); err != nil {
			t.Errorf("%s: --kv-events-config %s: %v", m, events, err)
		}
		if !kv.Enable {
			t.Errorf("%s: --kv-events-config does not set enable_kv_cache_events", m)
		}
		for endpoint, key := range map[string]string{kv.Endpoint: "engine_endpoint", kv.ReplayEndpoint: "engine_replay_endpoint"} {
			_, enginePort, _ := strings.Cut(strings.TrimPrefix(endpoint, "tcp://"), ":")
			_, bridgePort, _ := strings.Cut(strings.TrimPrefix(settings[key], "tcp://"), ":")
			if enginePort != bridgePort {
				t.Errorf("%s: the engine publishes on %q, the bridge's %s is %q", m, endpoint, key, settings[key])
			}
		}
		if bs, _, _ := flagValue(args, "block-size"); bs != settings["block_size"] {
			t.Errorf("%s: the engine's --block-size is %q, the bridge's block_size %q: they must agree", m, bs, settings["block_size"])
		}
	}
}

// --- the Dockerfile ----------------------------------------------------------------------------

// reporter is the part of testing.T the lint uses, so that its own test can watch it fail.
type reporter interface {
	Helper()
	Errorf(format string, args ...any)
}

type recorder struct{ errs []string }

func (r *recorder) Helper() {}
func (r *recorder) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

// instruction is one Dockerfile instruction, continuation lines joined.
type instruction struct {
	line int
	cmd  string // upper case
	args string
}

func parseDockerfile(src string) []instruction {
	var out []instruction
	sc := bufio.NewScanner(strings.NewReader(src))
	var cur *instruction
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		cont := strings.HasSuffix(line, "\\")
		line = strings.TrimSpace(strings.TrimSuffix(line, "\\"))
		if cur == nil {
			cmd, args, _ := strings.Cut(line, " ")
			cur = &instruction{line: n, cmd: strings.ToUpper(cmd), args: strings.TrimSpace(args)}
		} else {
			cur.args += " " + line
		}
		if !cont {
			out = append(out, *cur)
			cur = nil
		}
	}
	return out
}

// execForm parses an instruction's exec (JSON array) form; ok is false for the shell form.
func execForm(args string) ([]string, bool) {
	var a []string
	if err := json.Unmarshal([]byte(args), &a); err != nil || len(a) == 0 {
		return nil, false
	}
	return a, true
}

func goVersion(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile("../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go (\S+)$`).FindSubmatch(data)
	if m == nil {
		t.Fatal("../go.mod has no go line")
	}
	return string(m[1])
}

func lintDockerfile(t reporter, src, goVersion string) {
	t.Helper()
	type stage struct {
		name, image string
		ins         []instruction
	}
	var stages []*stage
	for _, in := range parseDockerfile(src) {
		if in.cmd == "FROM" {
			f := strings.Fields(in.args)
			f = slices.DeleteFunc(f, func(s string) bool { return strings.HasPrefix(s, "--") }) // --platform
			s := &stage{}
			if len(f) > 0 {
				s.image = f[0]
			}
			if len(f) == 3 && strings.EqualFold(f[1], "AS") {
				s.name = f[2]
			}
			stages = append(stages, s)
			continue
		}
		if len(stages) == 0 {
			if in.cmd != "ARG" {
				t.Errorf("Dockerfile line %d: %s before the first FROM", in.line, in.cmd)
			}
			continue
		}
		stages[len(stages)-1].ins = append(stages[len(stages)-1].ins, in)
	}
	if len(stages) < 2 {
		t.Errorf("Dockerfile has %d stage(s): build in one stage, run from a minimal one", len(stages))
		return
	}
	names := map[string]bool{}
	for _, s := range stages {
		if !names[s.image] {
			_, tag, digest := imageRef(s.image)
			if s.image != "scratch" && (tag == "latest" || (tag == "" && digest == "")) {
				t.Errorf("Dockerfile: FROM %s is not pinned (a version tag other than latest, or a digest)", s.image)
			}
		}
		if s.name != "" {
			names[s.name] = true
		}
	}

	// The build: go build, static and without build paths, by go.mod's Go.
	built := false
	for _, s := range stages[:len(stages)-1] {
		if repo, tag, _ := imageRef(s.image); repo == "golang" && !strings.HasPrefix(tag, goVersion) {
			t.Errorf("Dockerfile: the builder is %s, go.mod says go %s", s.image, goVersion)
		}
		cgoOff := false
		for _, in := range s.ins {
			if in.cmd == "ENV" && regexp.MustCompile(`\bCGO_ENABLED[= ]0\b`).MatchString(in.args) {
				cgoOff = true
			}
			if in.cmd != "RUN" {
				continue
			}
			for _, gocmd := range regexp.MustCompile(`(?:^|&&|;)\s*((?:\S+=\S+\s+)*)go (build|install)\b([^&;]*)`).FindAllStringSubmatch(in.args, -1) {
				if !cgoOff && !strings.Contains(gocmd[1], "CGO_ENABLED=0") {
					t.Errorf("Dockerfile line %d: go %s without CGO_ENABLED=0: the binary would need the builder's libc", in.line, gocmd[2])
				}
				if !strings.Contains(gocmd[3], "-trimpath") {
					t.Errorf("Dockerfile line %d: go %s without -trimpath", in.line, gocmd[2])
				}
				for _, pkg := range regexp.MustCompile(`\S+@(\S+)`).FindAllStringSubmatch(gocmd[3], -1) {
					if !regexp.MustCompile(`^v\d+\.\d+\.\d+$`).MatchString(pkg[1]) {
						t.Errorf("Dockerfile line %d: %s is not pinned to a version", in.line, pkg[0])
					}
				}
				if gocmd[2] == "build" && strings.Contains(gocmd[3], "./cmd/kvrouter") {
					built = true
				}
			}
		}
	}
	if !built {
		t.Errorf("Dockerfile: no build stage runs go build ./cmd/kvrouter")
	}

	for _, s := range stages {
		for _, in := range s.ins {
			if in.cmd == "ADD" && regexp.MustCompile(`(?i)\b(https?|ftp)://|\bgit@`).MatchString(in.args) {
				t.Errorf("Dockerfile line %d: ADD of a URL: fetch it in a build stage and check it, or COPY", in.line)
			}
			if from := regexp.MustCompile(`--from=(\S+)`).FindStringSubmatch(in.args); in.cmd == "COPY" && from != nil && !names[from[1]] {
				t.Errorf("Dockerfile line %d: COPY --from=%s names no earlier stage", in.line, from[1])
			}
		}
	}

	// The image that runs.
	final := stages[len(stages)-1]
	if final.image != "scratch" && !strings.HasPrefix(final.image, "gcr.io/distroless/") {
		t.Errorf("Dockerfile: the run stage is FROM %s: use distroless or scratch (no shell, no package manager)", final.image)
	}
	var user string
	copied := map[string]bool{}
	var entrypoint, cmd, health *instruction
	for _, in := range final.ins {
		switch in.cmd {
		case "USER":
			user = in.args
		case "COPY":
			if f := strings.Fields(in.args); len(f) > 0 {
				copied[f[len(f)-1]] = true
			}
		case "ENTRYPOINT":
			entrypoint = &in
		case "CMD":
			cmd = &in
		case "HEALTHCHECK":
			health = &in
		}
	}
	uid, _, _ := strings.Cut(user, ":")
	if n, err := strconv.Atoi(uid); err != nil || n == 0 {
		t.Errorf("Dockerfile: the run stage's USER is %q: a numeric user other than 0, so that Kubernetes' runAsNonRoot can verify it", user)
	}
	if entrypoint == nil {
		t.Errorf("Dockerfile: no ENTRYPOINT")
	} else if a, ok := execForm(entrypoint.args); !ok || !slices.Equal(a, []string{"/kvrouter"}) {
		t.Errorf("Dockerfile line %d: ENTRYPOINT %s, want the exec form [\"/kvrouter\"] (the shell form needs a shell and does not pass signals)", entrypoint.line, entrypoint.args)
	} else if !copied[a[0]] {
		t.Errorf("Dockerfile: the entry point %s is not copied into the run stage", a[0])
	}
	if cmd == nil {
		t.Errorf("Dockerfile: no CMD")
	} else if a, ok := execForm(cmd.args); !ok || !slices.Equal(a, []string{"serve"}) {
		t.Errorf("Dockerfile line %d: CMD %s, want the exec form [\"serve\"]", cmd.line, cmd.args)
	}
	if health != nil {
		hc := health.args
		if i := strings.Index(hc, "CMD "); i >= 0 {
			hc = strings.TrimSpace(hc[i+len("CMD "):])
		}
		if a, ok := execForm(hc); !ok {
			t.Errorf("Dockerfile line %d: HEALTHCHECK %s is not in exec form: the run stage has no shell", health.line, health.args)
		} else if !copied[a[0]] {
			t.Errorf("Dockerfile line %d: HEALTHCHECK runs %s, which the run stage does not hold", health.line, a[0])
		}
	}
}

// TestInferencePool checks the gateway overlay's wiring as a gateway would follow it: the HTTPRoute
// sends to an InferencePool of the unit; the pool's endpointPickerRef names a Service port that
// reaches a router container serving the picker (KVROUTER_PICKER_LISTEN or --picker-listen) on
// that port; and the pool selects the model servers of examples/vllm-with-bridge.yaml on the port
// their bridges register as the worker's endpoint, which is what the picker names to the proxy.
func TestInferencePool(t *testing.T) {
	var engines unit
	for _, u := range units(t) {
		if u.name == "examples/vllm-with-bridge.yaml" {
			engines = u
		}
	}
	found := 0
	for _, u := range units(t) {
		for _, pool := range u.docs {
			if pool.kind() != "InferencePool" {
				continue
			}
			found++
			t.Run(u.name+"/"+pool.name(), func(t *testing.T) { checkInferencePool(t, u, pool, engines) })
		}
	}
	if found == 0 {
		t.Error("no InferencePool in any unit: overlays/gateway should have one")
	}
}

func checkInferencePool(t *testing.T, u unit, pool manifest, engines unit) {
	checkPoolEngines(t, pool, engines)
	routed := false
	for _, m := range u.docs {
		if m.kind() != "HTTPRoute" {
			continue
		}
		for _, rule := range list(m.doc, "spec", "rules") {
			for _, ref := range list(rule, "backendRefs") {
				if str(ref, "kind") == "InferencePool" && str(ref, "group") == "inference.networking.k8s.io" && str(ref, "name") == pool.name() {
					routed = true
					// The picker answers other paths 404: the route must not send them.
					for _, match := range list(rule, "matches") {
						if path := str(match, "path", "value"); str(match, "path", "type") != "Exact" || path != "/v1/completions" && path != "/v1/chat/completions" {
							t.Errorf("%s: sends path %s %q to the pool, which the picker does not route", m, str(match, "path", "type"), path)
						}
					}
				}
			}
		}
	}
	if !routed {
		t.Errorf("%s: no HTTPRoute of the unit sends to it", pool)
	}
	picker := str(pool.doc, "spec", "endpointPickerRef", "name")
	pickerPort, _ := get(pool.doc, "spec", "endpointPickerRef", "port", "number").(int)
	var target string
	for _, m := range u.docs {
		if m.kind() != "Service" || m.name() != picker {
			continue
		}
		for _, p := range list(m.doc, "spec", "ports") {
			if n, _ := get(p, "port").(int); n == pickerPort {
				target = fmt.Sprint(get(p, "targetPort"))
			}
		}
		routers := selected(u, labels(m.doc, "spec", "selector"))
		if len(routers) != 1 {
			t.Fatalf("%s: selects %d workloads, want the routers", m, len(routers))
		}
		for _, c := range list(podSpec(routers[0].doc), "containers") {
			for _, p := range list(c, "ports") {
				if str(p, "name") != target && fmt.Sprint(get(p, "containerPort")) != target {
					continue
				}
				port := fmt.Sprint(get(p, "containerPort"))
				listen := ""
				for _, e := range list(c, "env") {
					if str(e, "name") == "KVROUTER_PICKER_LISTEN" {
						listen = str(e, "value")
					}
				}
				for _, a := range stringList(c, "args") {
					if v, ok := strings.CutPrefix(a, "--picker-listen="); ok {
						listen = v
					}
				}
				if _, p, _ := net.SplitHostPort(listen); p != port {
					t.Errorf("%s: the picker Service reaches container port %s, where kvrouter serves no picker (picker_listen %q)", routers[0], port, listen)
				}
				return
			}
		}
		t.Fatalf("%s: port %d targets %q, which names no port of the routers", m, pickerPort, target)
	}
	if target == "" {
		t.Fatalf("%s: endpointPickerRef %s:%d names no Service port of the unit", pool, picker, pickerPort)
	}
}

// checkPoolEngines: the pool selects the engine pods of engines, on the port of their engine
// container that their bridges register as the worker's endpoint.
func checkPoolEngines(t *testing.T, pool manifest, engines unit) {
	t.Helper()
	pods := selected(engines, labels(pool.doc, "spec", "selector", "matchLabels"))
	if len(pods) != 1 {
		t.Fatalf("%s: selector selects %d workloads of %s, want its engines", pool, len(pods), engines.name)
	}
	ports := list(pool.doc, "spec", "targetPorts")
	if len(ports) != 1 {
		t.Fatalf("%s: %d targetPorts, want the engine's one", pool, len(ports))
	}
	want := fmt.Sprint(get(ports[0], "number"))
	for _, c := range list(podSpec(pods[0].doc), "containers") {
		for _, a := range stringList(c, "args") {
			if v, ok := strings.CutPrefix(a, "--worker-endpoint="); ok {
				if _, p, _ := net.SplitHostPort(v); p != want {
					t.Errorf("%s: targetPort %s, but the bridge registers the worker at %s: the picker would name endpoints the pool does not hold", pool, want, v)
				}
				return
			}
		}
	}
	t.Errorf("%s: no bridge of %s registers a --worker-endpoint", pool, pods[0])
}
