package policy

import (
	"fmt"
	"slices"
	"sync"
)

// named is what a registry holds: a value that knows its configuration name.
type named interface{ String() string }

// registry maps configuration names to extension values (conditional-disaggregation policies,
// scorers), in registration order so that messages list them the same way every time.
type registry[T named] struct {
	kind   string // "conditional-disaggregation policy", "scorer": for the panic message
	mu     sync.RWMutex
	byName map[string]T
	order  []string
}

// register adds v under its name and returns what removes it again. A name registered twice, or
// an empty one, is a programming error and panics.
func (r *registry[T]) register(v T) (unregister func()) {
	name := v.String()
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, dup := r.byName[name]; dup || name == "" {
		panic(fmt.Sprintf("policy: %s %q registered twice (or unnamed)", r.kind, name))
	}
	if r.byName == nil {
		r.byName = make(map[string]T)
	}
	r.byName[name] = v
	r.order = append(r.order, name)
	return func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		delete(r.byName, name)
		if i := slices.Index(r.order, name); i >= 0 {
			r.order = slices.Delete(r.order, i, i+1)
		}
	}
}

// lookup returns the value registered under name, exactly (case-sensitive).
func (r *registry[T]) lookup(name string) (T, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	v, ok := r.byName[name]
	return v, ok
}

// quotedNames returns the registered names, quoted ('a'), in registration order.
func (r *registry[T]) quotedNames() []string {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]string, len(r.order))
	for i, n := range r.order {
		out[i] = "'" + n + "'"
	}
	return out
}
