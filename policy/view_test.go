package policy

import (
	"errors"
	"reflect"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

// TestKeyedPromptContract: Decide reads the key it is given when that key was made for the model's
// block size, and keys the request's prompt itself otherwise (no key, a zero key, a key for another
// block size). A key of another prompt is read as given, which shows the kernel does not hash
// again a prompt its caller keyed.
func TestKeyedPromptContract(t *testing.T) {
	f := newFleet(t)
	f.add(1, 0, kvstate.RoleAggregated, 0)
	f.add(2, 0, kvstate.RoleAggregated, 0)
	warm, cold := prompt(8*testBlockSize), prompt(8*testBlockSize)
	for i := range cold {
		cold[i] += 1 << 30
	}
	f.cache(2, warm, 8)
	keyed := func(tokens []uint32, blockSize uint32) *KeyedPrompt {
		p := &KeyedPrompt{}
		p.Key(&Request{Tokens: tokens}, blockSize)
		return p
	}
	type result struct {
		Worker   uint64
		Overlap  uint64
		Blocks   uint64
		Uncached uint64
	}
	for _, tc := range []struct {
		name   string
		tokens []uint32
		key    *KeyedPrompt
		want   result
	}{
		{"no key: the kernel keys the prompt", warm, nil, result{2, 8, 8, 0}},
		{"a zero key is keyed for no block size", warm, &KeyedPrompt{}, result{2, 8, 8, 0}},
		{"the caller's key", warm, keyed(warm, testBlockSize), result{2, 8, 8, 0}},
		{"a key for another block size is not read", warm, keyed(cold, 2*testBlockSize), result{2, 8, 8, 0}},
		{"a key is read as given, not hashed again", cold, keyed(warm, testBlockSize), result{2, 8, 8, 0}},
		{"a cold prompt keyed by the kernel", cold, nil, result{1, 0, 8, 8 * testBlockSize}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := f.router(DefaultConfig()).Kernel
			req := &Request{Model: "m", Tokens: tc.tokens, QueryOnly: true}
			dec, err := k.Decide(req, tc.key)
			if err != nil {
				t.Fatalf("Decide() = %v", err)
			}
			got := result{dec.Decode.Worker.Info.Key.ID, dec.Decode.Overlap[kvstate.TierDevice], dec.PromptBlocks, k.UncachedTokens(req, tc.key)}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("decision mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

// TestHashedPrompt: a prompt its caller keyed (Request.Hashed) is decided as its token ids are,
// partial last block included, and one keyed for another block size than the model's is refused
// rather than matched against nothing.
func TestHashedPrompt(t *testing.T) {
	f := newFleet(t)
	f.add(1, 0, kvstate.RoleAggregated, 0)
	f.add(2, 0, kvstate.RoleAggregated, 0)
	warm := prompt(8*testBlockSize + 3)
	f.cache(2, warm, 8)
	k := f.router(DefaultConfig()).Kernel
	type result struct {
		Worker                 uint64
		Overlap, Blocks        uint64
		PromptTokens, Uncached uint64
	}
	decide := func(req *Request) result {
		t.Helper()
		dec, err := k.Decide(req, nil)
		if err != nil {
			t.Fatalf("Decide() = %v", err)
		}
		return result{dec.Decode.Worker.Info.Key.ID, dec.Decode.Overlap[kvstate.TierDevice], dec.PromptBlocks, dec.PromptTokens, k.UncachedTokens(req, nil)}
	}
	want := decide(&Request{Model: "m", Tokens: warm, QueryOnly: true})
	if want != (result{2, 8, 8, 8*testBlockSize + 3, 3}) {
		t.Fatalf("the token ids' decision = %+v", want)
	}
	locals := blockhash.Locals(nil, warm, testBlockSize, blockhash.Salt("", ""))
	hashed := &Request{Model: "m", QueryOnly: true, Hashed: &HashedPrompt{Locals: locals, BlockSize: testBlockSize, Tokens: uint64(len(warm))}}
	if diff := cmp.Diff(want, decide(hashed)); diff != "" {
		t.Errorf("the hashed prompt's decision (-tokens +hashed):\n%s", diff)
	}
	other := &Request{Model: "m", QueryOnly: true, Hashed: &HashedPrompt{Locals: locals[:4], BlockSize: 2 * testBlockSize, Tokens: uint64(len(warm))}}
	if _, err := k.Decide(other, nil); !errors.Is(err, kvstate.ErrBlockSizeMismatch) {
		t.Errorf("Decide(hashed for blocks of %d) = %v, want ErrBlockSizeMismatch", 2*testBlockSize, err)
	}
	if got := k.UncachedTokens(other, nil); got != uint64(len(warm)) {
		t.Errorf("UncachedTokens(hashed for another block size) = %d, want all %d", got, len(warm))
	}
}

// TestViewsOfferReadsOnly pins the method sets of the kernel's view and of the kvstate handles
// behind it: a method added to any of them is a decision to let the kernel do more than read, to be
// made here, in review, rather than by accident.
func TestViewsOfferReadsOnly(t *testing.T) {
	methods := func(t reflect.Type) []string {
		var names []string
		for i := range t.NumMethod() {
			names = append(names, t.Method(i).Name)
		}
		return names
	}
	got := map[string][]string{
		"View":                methods(reflect.TypeFor[View]()),
		"ModelView":           methods(reflect.TypeFor[ModelView]()),
		"LoadView":            methods(reflect.TypeFor[LoadView]()),
		"kvstate.ReadView":    methods(reflect.TypeFor[kvstate.ReadView]()),
		"kvstate.ModelReader": methods(reflect.TypeFor[kvstate.ModelReader]()),
		"kvstate.LoadReader":  methods(reflect.TypeFor[kvstate.LoadReader]()),
	}
	want := map[string][]string{
		"View":                {"Load", "Model"},
		"ModelView":           {"AppendWorkers", "BlockSize", "Overlaps"},
		"LoadView":            {"ActiveDepths", "Slots"},
		"kvstate.ReadView":    {"Load", "Model"},
		"kvstate.ModelReader": {"AppendWorkers", "BlockSize", "Name", "Overlaps"},
		"kvstate.LoadReader":  {"ActiveDepths", "Slots"},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("method sets mismatch (-want +got):\n%s", diff)
	}
}

// TestKernelConfigIsFixedAtConstruction: changing the Config a kernel was made with, a threshold it
// points to, the filter list given to WithFilters or the Config read back changes nothing the
// kernel decides with.
func TestKernelConfigIsFixedAtConstruction(t *testing.T) {
	cfg := DefaultConfig()
	cfg.QueueThreshold = ptr(2.0)
	cfg.ConditionalDisagg.DecodeBusyThreshold = ptr(0.5)
	filters := []Filter{maxRequests(1)}
	k := NewKernel(StateView(newFleet(t).state), cfg, WithFilters(filters...))
	cfg.RouterTemperature = 9
	*cfg.QueueThreshold = 7
	*cfg.ConditionalDisagg.DecodeBusyThreshold = 7
	filters[0] = maxRequests(5)
	back := k.Config()
	*back.QueueThreshold = 8
	got := k.Config()
	type fixed struct {
		Temperature, QueueThreshold, DecodeBusy float64
		Filters                                 []Filter
	}
	want := fixed{0, 2, 0.5, []Filter{maxRequests(1)}}
	if diff := cmp.Diff(want, fixed{got.RouterTemperature, *got.QueueThreshold, *got.ConditionalDisagg.DecodeBusyThreshold, k.filters}); diff != "" {
		t.Errorf("kernel configuration mismatch (-want +got):\n%s", diff)
	}
}
