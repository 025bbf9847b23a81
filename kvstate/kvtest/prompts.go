package kvtest

import "math/rand/v2"

// Shape is how generated prompts share prefixes, as prompts do in production: each takes a uniform
// fraction in [SharedMin, SharedMax] of its blocks from one of Roots "system prompts", then blocks
// nobody has seen.
type Shape struct {
	Roots                int
	SharedMin, SharedMax float64
}

// PeerShape is the peers' workload (peer-index-bench.md, "Workload shape"): prompts of 512 blocks
// sharing 128 to 384 of them with one of 100 roots.
var PeerShape = Shape{Roots: Roots, SharedMin: float64(SharedMin) / PromptBlocks, SharedMax: float64(SharedMax) / PromptBlocks}

// firstUniqueID is the content id of the first block no root holds: root ids stay below it.
const firstUniqueID = 1 << 48

// Prompts draws prompts of a Shape and names their blocks by content id: root r's block i is
// RootBlock(r, i), and every block nobody has seen takes the next id from 1<<48 up. A block's
// tokens follow from its id (BlockTokens), so equal ids are equal cached content on every worker,
// as with real engines. Every generator of the module (kvtest's Workload, policy's benchmarks,
// cmd/kvload) draws its prompts here.
type Prompts struct {
	Shape
	Rand   *rand.Rand
	nextID uint64
}

// NewPrompts returns a generator of shape's prompts drawing from rng.
func NewPrompts(shape Shape, rng *rand.Rand) *Prompts {
	return &Prompts{Shape: shape, Rand: rng, nextID: firstUniqueID}
}

// Draw returns a root and how many of a prompt's n blocks it shares with it, uniformly.
func (p *Prompts) Draw(n int) (root, shared int) {
	root = p.Rand.IntN(p.Roots)
	lo, hi := int(p.SharedMin*float64(n)), int(p.SharedMax*float64(n))
	return root, lo + p.Rand.IntN(hi-lo+1)
}

// NewIDs reserves the ids of n blocks nobody has seen, consecutive, and returns the first.
func (p *Prompts) NewIDs(n int) uint64 {
	first := p.nextID
	p.nextID += uint64(n)
	return first
}

// IDs appends the content ids of a prompt of n blocks whose first shared blocks are root's.
func (p *Prompts) IDs(dst []uint64, root, shared, n int) []uint64 {
	for i := range shared {
		dst = append(dst, RootBlock(root, i))
	}
	for first, i := p.NewIDs(n-shared), uint64(0); i < uint64(n-shared); i++ {
		dst = append(dst, first+i)
	}
	return dst
}

// RootBlock is the content id of block i of root.
func RootBlock(root, i int) uint64 { return uint64(root)<<32 | uint64(i) }

// BlockTokens appends the BlockSize tokens of the block with content id to dst. Equal ids give
// equal tokens, so prompts that share block ids share cached prefixes.
func BlockTokens(dst []uint32, id uint64) []uint32 { return BlockTokensOf(dst, id, BlockSize) }

// BlockTokensOf is BlockTokens for blocks of blockSize tokens.
func BlockTokensOf(dst []uint32, id uint64, blockSize int) []uint32 {
	for i := range uint64(blockSize) {
		dst = append(dst, uint32(Mix(id*uint64(blockSize)+i+1)%Vocab))
	}
	return dst
}
