package engine

import (
	"testing"
	"time"
)

// TestLlamaCostModel checks the model against the reference points it was fitted to (the research
// note behind Llama31_8B_H100): an idle prefill of 2k tokens in about 52 ms, decode steps of 7.8 ms
// at batch 1 and 11.1 ms at batch 32 with 2k context each, and a cached prefix that cuts an 8k
// prefill from about 227 ms to about 69 ms.
func TestLlamaCostModel(t *testing.T) {
	m := Llama31_8B_H100()
	prefill := func(n, cached int) time.Duration {
		var total time.Duration
		for done := 0; done < n; done += m.MaxNumBatchedTokens {
			total += m.Step(0, 0, []Chunk{{New: min(m.MaxNumBatchedTokens, n-done), Done: cached + done}})
		}
		return total
	}
	tests := []struct {
		name string
		got  time.Duration
		want time.Duration
	}{
		{"prefill 2k", prefill(2048, 0), 52 * time.Millisecond},
		{"prefill 8k", prefill(8192, 0), 227 * time.Millisecond},
		{"prefill 8k with 6k cached", prefill(2048, 6144), 68500 * time.Microsecond},
		{"prefill 32k", prefill(32768, 0), 1436 * time.Millisecond},
		{"decode batch 1, 2k context", m.Step(1, 2048, nil), 7810 * time.Microsecond},
		{"decode batch 32, 2k context each", m.Step(32, 32*2048, nil), 11100 * time.Microsecond},
		{"decode batch 128, 1k context each", m.Step(128, 128*1024, nil), 14600 * time.Microsecond},
		{"transfer of 128 blocks (2k tokens)", m.Transfer(128), 11740 * time.Microsecond},
	}
	for _, tt := range tests {
		if d := tt.got - tt.want; d < -tt.want/50 || d > tt.want/50 {
			t.Errorf("%s = %v, want %v within 2%%", tt.name, tt.got, tt.want)
		}
	}
	// Local prefill slows the decode step it shares: 64 decodes at 2k context, with a 2k chunk.
	alone, mixed := m.Step(64, 64*2048, nil), m.Step(64, 64*2048, []Chunk{{New: 2048}})
	if penalty := mixed - alone; penalty < 40*time.Millisecond || penalty > 60*time.Millisecond {
		t.Errorf("a 2k-token chunk adds %v to a step of 64 decodes, want about 46 ms", penalty)
	}
	if m.Step(0, 0, nil) != 0 {
		t.Errorf("an empty pass takes %v, want 0", m.Step(0, 0, nil))
	}
}

// TestScaled: Scaled multiplies the attention constants and the transfer times it is given and
// leaves the rest of the model alone; 1 and 1 is the model itself.
func TestScaled(t *testing.T) {
	m := Llama31_8B_H100()
	if got := m.Scaled(1, 1); got != m {
		t.Errorf("Scaled(1, 1) = %+v, want the model unchanged", got)
	}
	s := m.Scaled(2, 0.5)
	want := m
	want.Name = m.Name + " (attention 2x, network 0.5x)"
	want.DecodePerContextTokenNs, want.PrefillPerTokenPairNs = 2*m.DecodePerContextTokenNs, 2*m.PrefillPerTokenPairNs
	want.TransferSetup, want.TransferPerBlock = m.TransferSetup/2, m.TransferPerBlock/2
	if s != want {
		t.Errorf("Scaled(2, 0.5) = %+v, want %+v", s, want)
	}
}
