package policy

import (
	"fmt"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/kvstate/blockhash"
)

// View is the state a decision reads, and only reads: a model's block size, workers and prefix
// overlaps, and the booked load. Its methods hand out nothing that changes the state, so a kernel
// holding a View cannot book, index or unregister anything: the compiler keeps it pure. StateView
// adapts a kvstate.State; tests may fake it.
type View interface {
	// Model returns the named model, or nil when no worker serves it.
	Model(name string) ModelView
	// Load returns the booked load of the view's workers.
	Load() LoadView
}

// ModelView is one model as a decision reads it. kvstate.ModelReader implements it.
type ModelView interface {
	// BlockSize returns the model's block size in tokens.
	BlockSize() uint32
	// AppendWorkers appends the model's workers, sorted by key, to dst: a copy, so that the
	// kernel's scratch, not the model's list, is what it sorts into pools.
	AppendWorkers(dst []*kvstate.Worker) []*kvstate.Worker
	// Overlaps fills o with every worker's overlap with the prompt whose sequence hashes are seq
	// (nil: no overlap anywhere, as when KV events are not used).
	Overlaps(seq []uint64, o *kvstate.Overlaps)
}

// LoadView is the booked load as a decision reads it. kvstate.LoadReader implements it.
type LoadView interface {
	// Slots appends the load of each of slots to dst, in the same order.
	Slots(dst []kvstate.SlotLoad, slots []uint32) []kvstate.SlotLoad
	// ActiveDepths fills o with each worker's run of the prompt's leading blocks (sequence hashes
	// seq) among its active blocks: those are not new load if the request lands there.
	ActiveDepths(seq []uint64, o *kvstate.Overlaps)
}

// StateView returns the View of s. It keeps only s's kvstate.ReadView, whose state is unexported,
// so nothing in this package can reach s's changes through it either.
func StateView(s *kvstate.State) View { return stateView{s.ReadView()} }

type stateView struct{ v kvstate.ReadView }

func (s stateView) Model(name string) ModelView {
	if m, ok := s.v.Model(name); ok {
		return m
	}
	return nil // a nil interface, not a ModelReader of no model
}

func (s stateView) Load() LoadView { return s.v.Load() }

var (
	_ ModelView = kvstate.ModelReader{}
	_ LoadView  = kvstate.LoadReader{}
)

// KeyedPrompt is a request's prompt keyed for its model: its token count and block size (Prompt),
// and the local and sequence hashes of its complete blocks, salted by the request's LoRA name and
// cache namespace, with its multimodal inputs folded in. Hashing is the one part of a decision
// whose cost grows with the prompt (a 32k-token prompt has 2,048 blocks to hash), so a Route keys
// its prompt once, before the decision, and everything after reads that key: the booking cap's
// check, the queue's WSPT order, every try of the decision while the request waits for capacity,
// and the blocks the decision books.
//
// The contract between a caller and the kernel is one rule: the kernel uses the key it is given
// when that key was made for the model's block size, and keys the prompt itself (in its pooled
// scratch) otherwise. A caller that keys passes the key; one with no use for the key before the
// decision (a test, a one-off query) passes nil. A key made for another block size (the model went
// and came back with a new one between the two calls) is never read. A key must be made from the
// request it is passed with (its tokens, LoRA name, cache namespace and multimodal inputs): the
// kernel cannot tell a key of another prompt. The kernel never keeps or changes a key, so its
// buffers may be reused once the call returns.
type KeyedPrompt struct {
	Prompt
	// Locals are the local hashes of the prompt's complete blocks (blockhash.Locals).
	Locals []uint64
	// Seq are their sequence hashes (blockhash.Sequence): the keys of the prefix index and of the
	// booked blocks shared between requests.
	Seq []uint64

	keyed bool // set by Key: a zero KeyedPrompt is keyed for no block size, not for 0
}

// Key keys req's prompt into p for blocks of blockSize tokens, reusing p's buffers, so that a
// pooled KeyedPrompt keys without allocating. A prompt the caller hashed (req.Hashed) is taken as
// it is: its block size must be blockSize (Request.checkBlockSize), which the kernel checks before
// it keys.
func (p *KeyedPrompt) Key(req *Request, blockSize uint32) {
	p.Prompt = Prompt{Tokens: req.PromptTokens(), BlockSize: blockSize}
	if h := req.Hashed; h != nil {
		// Copied: the key outlives the call in a pool, and the request's slice is not its own.
		p.Locals = append(p.Locals[:0], h.Locals...)
	} else {
		salt := blockhash.Salt(req.LoraName, req.CacheNamespace)
		p.Locals = blockhash.LocalsMultimodal(p.Locals[:0], req.Tokens, int(blockSize), salt, req.Multimodal)
	}
	p.Seq = blockhash.Sequence(p.Seq[:0], p.Locals)
	p.keyed = true
}

// HashedPrompt is a prompt its caller keyed (RouteRequest.block_hashes): the router routes it as
// it would the token ids behind it, without decoding or hashing them. The caller must hash as the
// router does (the model's block size, salts and multimodal inputs): a wrong hash changes only this
// request's overlap (a miss, or a hit its tokens would not have), nothing in the state.
type HashedPrompt struct {
	// Locals are the local hashes of the prompt's complete blocks (blockhash.LocalsMultimodal).
	Locals []uint64
	// BlockSize is the block size they were hashed with.
	BlockSize uint32
	// Tokens is the prompt's length: len(Locals) complete blocks and a partial one of fewer than
	// BlockSize tokens.
	Tokens uint64
}

// PromptTokens returns the prompt's length in tokens, hashed or not.
func (r *Request) PromptTokens() uint64 {
	if r.Hashed != nil {
		return r.Hashed.Tokens
	}
	return uint64(len(r.Tokens))
}

// checkBlockSize fails a hashed prompt hashed with another block size than the model's, blockSize:
// its hashes would match nothing.
func (r *Request) checkBlockSize(blockSize uint32) error {
	if h := r.Hashed; h != nil && h.BlockSize != blockSize {
		return fmt.Errorf("%w: block_size %d, but model %q has blocks of %d tokens: hash the prompt with the model's block size",
			kvstate.ErrBlockSizeMismatch, h.BlockSize, r.Model, blockSize)
	}
	return nil
}

// KeyedFor reports whether p holds a key made for blocks of blockSize tokens (false for nil).
func (p *KeyedPrompt) KeyedFor(blockSize uint32) bool {
	return p != nil && p.keyed && p.BlockSize == blockSize
}

// Option configures a kernel at its construction (NewKernel). A kernel has no setters: what it
// decides with is fixed when it is made, so a decision in flight never sees its picker, filters or
// randomness change under it.
type Option func(*Kernel)

// WithPicker makes the kernel choose among each hop's costs with p; nil keeps TemperaturePicker.
func WithPicker(p Picker) Option { return func(k *Kernel) { k.picker = p } }

// WithFilters makes the kernel drop candidates with filters, in order, after its own eligibility
// rules. The kernel keeps its own copy of the list.
func WithFilters(filters ...Filter) Option {
	return func(k *Kernel) { k.filters = append([]Filter(nil), filters...) }
}

// WithRand makes the kernel draw its tie-breaks and softmax samples from r; nil keeps GlobalRand.
// Tests pass fixed draws.
func WithRand(r Rand) Option { return func(k *Kernel) { k.rand = r } }

// clone returns c with its pointer fields copied, so that neither the caller that built c nor one
// that reads it back (Kernel.Config) shares a threshold a kernel decides with.
func (c Config) clone() Config {
	c.OverlapScoreWeight = clonePtr(c.OverlapScoreWeight)
	c.QueueThreshold = clonePtr(c.QueueThreshold)
	c.ConditionalDisagg.PrefillBusyThreshold = clonePtr(c.ConditionalDisagg.PrefillBusyThreshold)
	c.ConditionalDisagg.DecodeBusyThreshold = clonePtr(c.ConditionalDisagg.DecodeBusyThreshold)
	return c
}

func clonePtr[T any](p *T) *T {
	if p == nil {
		return nil
	}
	v := *p
	return &v
}
