package app

import (
	"context"
	"errors"
	"testing"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/policy"
)

// TestBookingCap: a Route whose booking would make the replica's bookings hold more than
// BookingCap.Max block keys is refused (ErrBookingsFull) and books nothing; freeing makes room
// again, and query-only Routes are never refused. Before, bookings were bounded by nothing but
// their expiry: each 1M-token Route pinned about 1 MB for 300 s.
func TestBookingCap(t *testing.T) {
	f := newFleet(t)
	f.add(1, kvstate.RoleAggregated, 1<<20)
	d := f.cappedDispatcher(policy.DefaultConfig(), &BookingCap{Max: 40, Held: f.state.Load().HeldBlocks}) // 16-block prompts: two fit
	tokens := prompt(16 * testBlockSize)
	route := func(id string) error {
		_, err := d.Route(context.Background(), request(id, tokens))
		return err
	}
	for _, id := range []string{"a", "b"} {
		if err := route(id); err != nil {
			t.Fatalf("Route(%s) = %v, want booked", id, err)
		}
	}
	if got := f.state.Load().HeldBlocks(); got != 32 {
		t.Errorf("HeldBlocks() = %d after two 16-block bookings, want 32", got)
	}
	if err := route("c"); !errors.Is(err, ErrBookingsFull) {
		t.Fatalf("Route(c) past the cap = %v, want ErrBookingsFull", err)
	}
	if f.state.Load().Booked("c") {
		t.Error("the refused request c is booked")
	}
	query := request("", tokens)
	query.QueryOnly = true
	if _, err := d.Route(context.Background(), query); err != nil {
		t.Errorf("query-only Route at the cap = %v, want it answered", err)
	}
	if err := d.Free(context.Background(), "a"); err != nil {
		t.Fatal(err)
	}
	if err := route("c"); err != nil {
		t.Errorf("Route(c) after a Free = %v, want booked", err)
	}
	for _, id := range []string{"b", "c"} {
		if err := d.Free(context.Background(), id); err != nil {
			t.Fatal(err)
		}
	}
	if got := f.state.Load().HeldBlocks(); got != 0 {
		t.Errorf("HeldBlocks() = %d with no booking left, want 0", got)
	}
}

// TestCredentialBookingCap: a Route whose booking would make its owner's bookings hold more than
// Request.OwnerMaxBlocks is refused (ErrCredentialBookingsFull), while other owners, and requests
// owned by no one, book up to BookingCap.Max; freeing makes room again.
func TestCredentialBookingCap(t *testing.T) {
	f := newFleet(t)
	f.add(1, kvstate.RoleAggregated, 1<<20)
	load := f.state.Load()
	// 16 blocks a booking: four fit in all, two for each owner.
	d := f.cappedDispatcher(policy.DefaultConfig(), &BookingCap{Max: 70, Held: load.HeldBlocks, HeldBy: load.HeldBlocksOf})
	tokens := prompt(16 * testBlockSize)
	route := func(owner, id string) error {
		req := request(id, tokens)
		req.Owner, req.OwnerMaxBlocks = owner, 40
		_, err := d.Route(context.Background(), req)
		return err
	}
	for _, step := range []struct {
		owner, id string
		want      error
	}{
		{"a", "a1", nil}, {"a", "a2", nil},
		{"a", "a3", ErrCredentialBookingsFull},
		{"b", "b1", nil}, // another credential keeps its room
		{"", "n1", nil},  // owned by no one: only Max bounds it
		{"b", "b2", ErrBookingsFull},
	} {
		if err := route(step.owner, step.id); !errors.Is(err, step.want) || (step.want == nil) != (err == nil) {
			t.Fatalf("Route(%s by %q) = %v, want %v", step.id, step.owner, err, step.want)
		}
		if booked := load.Booked(step.id); booked != (step.want == nil) {
			t.Fatalf("%s booked: %v, want %v", step.id, booked, step.want == nil)
		}
	}
	if got := [3]int{load.HeldBlocksOf("a"), load.HeldBlocksOf("b"), load.HeldBlocks()}; got != [3]int{32, 16, 64} {
		t.Errorf("held by a, by b, in all = %v, want [32 16 64]", got)
	}
	if err := d.Free(context.Background(), "a1"); err != nil {
		t.Fatal(err)
	}
	if err := route("a", "a3"); err != nil {
		t.Errorf("Route(a3) after a's Free = %v, want booked", err)
	}
}

// TestLongPromptRefusedBeforeTheDecision: a caller at its cap is refused a long prompt's booking
// before the kernel decides (a decision that would fail, here pinned to a worker that does not
// exist, is never made): hashing and scoring a 1M-token prompt is most of what refusing it cost.
func TestLongPromptRefusedBeforeTheDecision(t *testing.T) {
	f := newFleet(t)
	f.add(1, kvstate.RoleAggregated, 1<<20)
	load := f.state.Load()
	d := f.cappedDispatcher(policy.DefaultConfig(), &BookingCap{Held: load.HeldBlocks, HeldBy: load.HeldBlocksOf})
	long := prompt(roomBeforeBlocks * testBlockSize)
	req := request("first", long)
	req.Owner, req.OwnerMaxBlocks = "a", roomBeforeBlocks
	if _, err := d.Route(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	pinned := request("second", long)
	pinned.Owner, pinned.OwnerMaxBlocks = "a", roomBeforeBlocks
	pinned.DecodePin = &policy.Pin{Worker: 99}
	if _, err := d.Route(context.Background(), pinned); !errors.Is(err, ErrCredentialBookingsFull) {
		t.Errorf("a long prompt's booking past the cap, pinned to no worker = %v, want ErrCredentialBookingsFull before the decision", err)
	}
	short := request("third", prompt(testBlockSize))
	short.Owner, short.OwnerMaxBlocks = "a", roomBeforeBlocks
	short.DecodePin = &policy.Pin{Worker: 99}
	if _, err := d.Route(context.Background(), short); !errors.Is(err, policy.ErrPinnedWorkerNotFound) {
		t.Errorf("a short prompt pinned to no worker = %v, want the decision's ErrPinnedWorkerNotFound (short prompts are checked after it)", err)
	}
}
