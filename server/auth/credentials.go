package auth

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"

	"gopkg.in/yaml.v3"
)

// Role is what a credential may do.
type Role uint8

// Roles.
const (
	// RoleWorker may publish KV events and load (WorkerService), for its worker ids and models.
	RoleWorker Role = 1 << iota
	// RoleFrontend may route requests (RouterService).
	RoleFrontend
	// RoleAdmin may read the fleet and the configuration (AdminService).
	RoleAdmin
)

var roleNames = []struct {
	role Role
	name string
}{{RoleWorker, "worker"}, {RoleFrontend, "frontend"}, {RoleAdmin, "admin"}}

func (r Role) String() string {
	var names []string
	for _, n := range roleNames {
		if r&n.role != 0 {
			names = append(names, n.name)
		}
	}
	if len(names) == 0 {
		return "none"
	}
	return strings.Join(names, ",")
}

// fileCredential is one entry of the credentials file, as written.
type fileCredential struct {
	Name              string   `yaml:"name"`
	Roles             []string `yaml:"roles"`
	TokenSHA256       string   `yaml:"token_sha256"`
	Identity          string   `yaml:"identity"`
	WorkerIDs         []uint64 `yaml:"worker_ids"`
	AnyWorker         bool     `yaml:"any_worker"`
	Models            []string `yaml:"models"`
	RouteRateLimit    *float64 `yaml:"route_rate_limit"`
	RouteTokenRate    *float64 `yaml:"route_token_rate_limit"`
	EventRateLimit    *float64 `yaml:"event_rate_limit"`
	MaxPublishStreams *int     `yaml:"max_publish_streams"`
	MaxBookedBlocks   *int     `yaml:"max_booked_blocks"`
}

// credentialsFile is the credentials file, as written.
type credentialsFile struct {
	Credentials []fileCredential `yaml:"credentials"`
}

// Credential is one caller let in: how it proves who it is (a bearer token whose SHA-256 the file
// holds, a client certificate naming its identity, or both), what it may do, and its limits.
type Credential struct {
	Name     string
	Roles    Role
	token    [32]byte // SHA-256 of the bearer token
	hasToken bool
	Identity string // a URI or DNS SAN of the client certificate
	// Workers are the worker ids a worker credential may publish for; nil with AnyWorker.
	Workers   []uint64
	AnyWorker bool
	// Models are the models it may publish for; nil means any.
	Models []string
	// Limits override the configured defaults when set.
	RouteRateLimit    *float64
	RouteTokenRate    *float64
	EventRateLimit    *float64
	MaxPublishStreams *int
	MaxBookedBlocks   *int
}

// table is one version of the credentials file, indexed for lookups.
type table struct {
	byToken    map[[32]byte]*Credential
	byIdentity map[string]*Credential
	all        []*Credential
}

var namePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

// parseCredentials reads a credentials file. Every rule is checked before anything is used, so a
// file with one bad entry changes nothing. Messages name the entry and the field, never a token
// hash or another credential's secret.
func parseCredentials(data []byte) (*table, error) {
	var f credentialsFile
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("not a credentials file: %w", err)
	}
	t := &table{byToken: map[[32]byte]*Credential{}, byIdentity: map[string]*Credential{}}
	names := map[string]bool{}
	for i, fc := range f.Credentials {
		where := fmt.Sprintf("credentials[%d]", i)
		if fc.Name != "" {
			where = fmt.Sprintf("credentials[%d] (%q)", i, fc.Name)
		}
		c, err := fc.credential()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", where, err)
		}
		if names[c.Name] {
			return nil, fmt.Errorf("%s: name: %q is used twice; names must be unique", where, c.Name)
		}
		names[c.Name] = true
		if c.hasToken {
			if other, dup := t.byToken[c.token]; dup {
				return nil, fmt.Errorf("%s: token_sha256: the same token is also %q's; tokens must be unique", where, other.Name)
			}
			t.byToken[c.token] = c
		}
		if c.Identity != "" {
			if other, dup := t.byIdentity[c.Identity]; dup {
				return nil, fmt.Errorf("%s: identity: %q is also %q's; identities must be unique", where, c.Identity, other.Name)
			}
			t.byIdentity[c.Identity] = c
		}
		t.all = append(t.all, c)
	}
	return t, nil
}

// credential checks one entry's rules and builds its Credential.
func (fc fileCredential) credential() (*Credential, error) {
	if !namePattern.MatchString(fc.Name) {
		return nil, fmt.Errorf("name: must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit (got %q)", fc.Name)
	}
	c := &Credential{Name: fc.Name, Identity: fc.Identity, AnyWorker: fc.AnyWorker, Models: fc.Models,
		RouteRateLimit: fc.RouteRateLimit, RouteTokenRate: fc.RouteTokenRate, EventRateLimit: fc.EventRateLimit, MaxPublishStreams: fc.MaxPublishStreams,
		MaxBookedBlocks: fc.MaxBookedBlocks}
	if len(fc.Roles) == 0 {
		return nil, errors.New("roles: must list at least one of worker, frontend, admin")
	}
	for _, r := range fc.Roles {
		i := slices.IndexFunc(roleNames, func(n struct {
			role Role
			name string
		}) bool {
			return n.name == r
		})
		if i < 0 {
			return nil, fmt.Errorf("roles: %q is not a role; roles are worker, frontend and admin", r)
		}
		c.Roles |= roleNames[i].role
	}
	if fc.TokenSHA256 == "" && fc.Identity == "" {
		return nil, errors.New("needs token_sha256 (the SHA-256 of its bearer token, in hex) or identity (its client certificate's URI or DNS SAN), or both")
	}
	if fc.TokenSHA256 != "" {
		b, err := hex.DecodeString(fc.TokenSHA256)
		if err != nil || len(b) != 32 {
			return nil, errors.New("token_sha256: must be 64 hex digits, the SHA-256 of the token (printf %s \"$TOKEN\" | sha256sum), never the token itself")
		}
		copy(c.token[:], b)
		c.hasToken = true
	}
	isWorker := c.Roles&RoleWorker != 0
	switch {
	case isWorker && len(fc.WorkerIDs) == 0 && !fc.AnyWorker:
		return nil, errors.New("worker_ids: a worker credential must list the worker ids it publishes for (or set any_worker: true)")
	case len(fc.WorkerIDs) > 0 && fc.AnyWorker:
		return nil, errors.New("worker_ids and any_worker: set one, not both")
	case !isWorker && (len(fc.WorkerIDs) > 0 || fc.AnyWorker || len(fc.Models) > 0):
		return nil, errors.New("worker_ids, any_worker and models: only a credential with role worker has them")
	case slices.Contains(fc.WorkerIDs, 0):
		return nil, errors.New("worker_ids: 0 is not a worker id")
	case slices.Contains(fc.Models, ""):
		return nil, errors.New("models: a model name must not be empty")
	}
	c.Workers = slices.Sorted(slices.Values(fc.WorkerIDs))
	for _, l := range []struct {
		name string
		v    *float64
	}{{"route_rate_limit", fc.RouteRateLimit}, {"route_token_rate_limit", fc.RouteTokenRate}, {"event_rate_limit", fc.EventRateLimit}} {
		if l.v != nil && !(*l.v >= 0) {
			return nil, fmt.Errorf("%s: must be >= 0 (got %v)", l.name, *l.v)
		}
	}
	if fc.MaxPublishStreams != nil && *fc.MaxPublishStreams < 1 {
		return nil, fmt.Errorf("max_publish_streams: must be >= 1 (got %d)", *fc.MaxPublishStreams)
	}
	if fc.MaxBookedBlocks != nil && *fc.MaxBookedBlocks < 0 {
		return nil, fmt.Errorf("max_booked_blocks: must be >= 0 (got %d; 0: no bound)", *fc.MaxBookedBlocks)
	}
	return c, nil
}

// MayPublishFor says why the credential may not publish for the worker and model, or nil.
func (c *Credential) MayPublishFor(worker uint64, model string) error {
	if !c.AnyWorker && !slices.Contains(c.Workers, worker) {
		return fmt.Errorf("credential %q may publish for worker ids %s, not %d", c.Name, formatIDs(c.Workers), worker)
	}
	if c.Models != nil && !slices.Contains(c.Models, model) {
		return fmt.Errorf("credential %q may publish for models %q, not %q", c.Name, c.Models, model)
	}
	return nil
}

func formatIDs(ids []uint64) string {
	parts := make([]string, len(ids))
	for i, id := range ids {
		parts[i] = fmt.Sprint(id)
	}
	return "[" + strings.Join(parts, " ") + "]"
}
