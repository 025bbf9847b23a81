package auth

import (
	"strings"
	"testing"
)

// FuzzParseCredentials: any file either parses into credentials that keep every rule (a name, a
// role, a way to prove who it is, worker ids exactly for workers, unique tokens and identities) or
// is refused whole with a message that never shows a token hash it was given.
func FuzzParseCredentials(f *testing.F) {
	f.Add("credentials:\n  - name: fe\n    roles: [frontend]\n    token_sha256: " + hashA + "\n")
	f.Add("credentials:\n  - name: w\n    roles: [worker]\n    worker_ids: [7, 8]\n    models: [llama]\n    identity: spiffe://fleet/w\n    event_rate_limit: 10\n    max_publish_streams: 2\n")
	f.Add("credentials:\n  - name: ops\n    roles: [admin, frontend]\n    token_sha256: " + hashA + "\n    route_rate_limit: 0.5\n  - name: ops\n    roles: [admin]\n    identity: x\n")
	f.Add("credentials: []\n")
	f.Add("")
	f.Fuzz(func(t *testing.T, file string) {
		tab, err := parseCredentials([]byte(file))
		if err != nil {
			// (The same digits elsewhere, as a name say, may be quoted back: they are not a token's.)
			onlyAsToken := strings.Count(file, hashA) == strings.Count(file, "token_sha256: "+hashA)
			if strings.Contains(file, hashA) && onlyAsToken && strings.Contains(err.Error(), hashA) {
				t.Fatalf("the error shows a token hash: %v", err)
			}
			return
		}
		names := map[string]bool{}
		for _, c := range tab.all {
			switch {
			case !namePattern.MatchString(c.Name) || names[c.Name]:
				t.Fatalf("credential name %q invalid or repeated", c.Name)
			case c.Roles == 0 || c.Roles&^(RoleWorker|RoleFrontend|RoleAdmin) != 0:
				t.Fatalf("credential %q has roles %b", c.Name, c.Roles)
			case !c.hasToken && c.Identity == "":
				t.Fatalf("credential %q proves nothing", c.Name)
			case c.Roles&RoleWorker != 0 && len(c.Workers) == 0 && !c.AnyWorker:
				t.Fatalf("worker credential %q names no worker", c.Name)
			case c.Roles&RoleWorker == 0 && (len(c.Workers) > 0 || c.AnyWorker || c.Models != nil):
				t.Fatalf("credential %q has worker scope without the role", c.Name)
			}
			names[c.Name] = true
			if c.hasToken && tab.byToken[c.token] != c {
				t.Fatalf("credential %q's token finds another", c.Name)
			}
			if c.Identity != "" && tab.byIdentity[c.Identity] != c {
				t.Fatalf("credential %q's identity finds another", c.Name)
			}
		}
	})
}
