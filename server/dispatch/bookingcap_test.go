package dispatch

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
	d := f.dispatcher(policy.DefaultConfig())
	d.Cap = &BookingCap{Max: 40, Held: f.state.Load().HeldBlocks} // 16-block prompts: two fit
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
