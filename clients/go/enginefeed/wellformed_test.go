package enginefeed

import (
	"runtime"
	"strings"
	"testing"
)

// TestDeclaredLengthsBounded: a payload that declares a string, binary, extension, array or map
// longer than what follows is refused as malformed at once, allocating nothing near the declared
// size; before, the first two inputs (found by FuzzDecode) made a skip allocate 1 to 2 GB.
func TestDeclaredLengthsBounded(t *testing.T) {
	tests := []struct{ name, payload string }{
		{"str32 of 1.9 GB in an unknown key's value", "\x930\x92\x8d\xac0000000000000\xb1parent_block_ash\xa9000000000000\x0f00000000\xc9o0000000000000"},
		{"ext32 of 1.9 GB", "\x930\x92\x9f\xa2\xa5\xae\x12\xdbv\x8d\xa4type0 000000000000"},
		{"bin32", "\x93\x00\x91\xc6\x7f\xff\xff\xff\x00"},
		{"array32", "\x93\x00\xdd\x7f\xff\xff\xff\x00"},
		{"map32", "\x93\x00\xdf\x7f\xff\xff\xff\x00"},
		{"str8 past the end", "\x93\x00\x91\xd9\x10abc"},
		{"a length cut short", "\x93\x00\x91\xdb\x00\x00"},
		{"0xc1", "\x93\x00\x91\xc1"},
	}
	d := NewDecoder()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			before := ms.TotalAlloc
			var b Batch
			err := d.Decode([]byte(tt.payload), &b)
			runtime.ReadMemStats(&ms)
			if e, ok := err.(*Error); !ok || e.Reason != Malformed {
				t.Fatalf("Decode() = %v, want a Malformed error", err)
			}
			if got := ms.TotalAlloc - before; got > 1<<20 {
				t.Errorf("Decode() allocated %d bytes for a %d-byte payload", got, len(tt.payload))
			}
			if strings.Contains(err.Error(), "\n") {
				t.Errorf("error %q spans lines", err)
			}
		})
	}
}
