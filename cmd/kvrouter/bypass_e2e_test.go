package main

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// grpcurlCall runs the real grpcurl with stdin as the request body(ies) and returns its output.
func grpcurlCall(t *testing.T, grpcurl, addr, method, body string) string {
	t.Helper()
	cmd := exec.Command(grpcurl, "-plaintext", "-emit-defaults", "-d", "@", addr, method)
	cmd.Stdin = strings.NewReader(body)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("grpcurl %s = %v\n%s", method, err, out)
	}
	return string(out)
}

func tokenRange(from, n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = from + i
	}
	return out
}

func mustJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return string(b)
}

// publishFleet registers prefill worker P1 (id 1), decode worker D1 (id 11), which caches 15 of the
// 16 blocks (block size 64) of the prompt of tokens 1..1024, and a cold decode worker D2 (id 12).
func publishFleet(t *testing.T, grpcurl, addr string, prompt []int) {
	t.Helper()
	hello := func(id int, role, endpoint string) map[string]any {
		return map[string]any{"hello": map[string]any{"workerId": id, "model": "llama", "role": role, "blockSize": 64,
			"totalKvBlocks": 4096, "maxNumBatchedTokens": 8192, "endpoint": endpoint, "supportsBypass": role == "WORKER_ROLE_DECODE", "kvEventsEnabled": true}}
	}
	var blocks []map[string]any
	for i := range 15 {
		blocks = append(blocks, map[string]any{"blockHash": 5000 + i, "tokenIds": prompt[i*64 : (i+1)*64]})
	}
	stored := map[string]any{"events": map[string]any{"events": []any{map[string]any{
		"eventId": 0, "storageTier": "STORAGE_TIER_DEVICE", "stored": map[string]any{"blocks": blocks}}}}}
	for _, w := range []struct {
		body string
		acks bool
	}{
		{mustJSON(hello(1, "WORKER_ROLE_PREFILL", "p1:8000")), false},
		{mustJSON(hello(11, "WORKER_ROLE_DECODE", "d1:8000")) + "\n" + mustJSON(stored), true},
		{mustJSON(hello(12, "WORKER_ROLE_DECODE", "d2:8000")), false},
	} {
		out := grpcurlCall(t, grpcurl, addr, "kvrouter.v1.WorkerService/Publish", w.body)
		if !strings.Contains(out, `"registered"`) || (w.acks && !strings.Contains(out, `"eventId": "0"`)) {
			t.Fatalf("Publish was not registered/acked:\n%s", out)
		}
	}
}

type routeAnswer struct {
	Mode    string
	Prefill string
	Decode  string
	Annot   []string
	Reason  string
}

func routeVia(t *testing.T, grpcurl, addr string, req map[string]any) routeAnswer {
	t.Helper()
	out := grpcurlCall(t, grpcurl, addr, "kvrouter.v1.RouterService/Route", mustJSON(req))
	var resp struct {
		Mode    string `json:"mode"`
		Prefill *struct {
			WorkerID string `json:"workerId"`
		} `json:"prefill"`
		Decode struct {
			WorkerID string `json:"workerId"`
		} `json:"decode"`
		Annotations []string `json:"annotations"`
		Diagnostics struct {
			Reason string `json:"reason"`
		} `json:"diagnostics"`
	}
	if err := json.Unmarshal([]byte(out), &resp); err != nil {
		t.Fatalf("Route output is not JSON: %v\n%s", err, out)
	}
	a := routeAnswer{Mode: resp.Mode, Decode: resp.Decode.WorkerID, Annot: resp.Annotations, Reason: resp.Diagnostics.Reason}
	if resp.Prefill != nil {
		a.Prefill = resp.Prefill.WorkerID
	}
	return a
}

// TestBypassEndToEnd is the acceptance scenario, with real kvrouter processes and grpcurl:
// D1 caches 15 of 16 blocks of a 1,024-token prompt and P1 exists, so the request bypasses to D1; a
// 16,384-token prompt cached nowhere goes to P1 and a decode worker; and with conditional
// disaggregation off, a client-sent marker is dropped and the request is disaggregated.
func TestBypassEndToEnd(t *testing.T) {
	grpcurl := grpcurlPath(t)
	bin := buildBinary(t)
	warm := tokenRange(1, 1024)
	cold := tokenRange(100_000, 16_384)

	on, _ := startServer(t, bin, "--conditional-disagg")
	publishFleet(t, grpcurl, on, warm)
	off, _ := startServer(t, bin)
	publishFleet(t, grpcurl, off, warm)

	tests := []struct {
		name string
		addr string
		req  map[string]any
		want routeAnswer
	}{
		{"warm prompt bypasses to D1", on,
			map[string]any{"requestId": "warm", "model": "llama", "tokenIds": warm},
			routeAnswer{Mode: "ROUTE_MODE_BYPASS", Decode: "11", Annot: []string{"x-bypass-remote-prefill"}, Reason: "DECISION_REASON_BYPASS"}},
		{"cold prompt is disaggregated", on,
			map[string]any{"requestId": "cold", "model": "llama", "tokenIds": cold},
			routeAnswer{Mode: "ROUTE_MODE_DISAGGREGATED", Prefill: "1", Decode: "12", Annot: []string{}, Reason: "DECISION_REASON_POLICY_DECLINED"}},
		{"client marker with conditional disagg off", off,
			map[string]any{"requestId": "forged", "model": "llama", "tokenIds": warm, "annotations": []string{"x-bypass-remote-prefill"}},
			// The decode hop is load-only with conditional disaggregation off: D1 and D2 tie.
			routeAnswer{Mode: "ROUTE_MODE_DISAGGREGATED", Prefill: "1", Decode: "11 or 12", Annot: []string{}, Reason: "DECISION_REASON_CONDITIONAL_DISAGG_OFF"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := routeVia(t, grpcurl, tt.addr, tt.req)
			if tt.want.Decode == "11 or 12" && (got.Decode == "11" || got.Decode == "12") {
				got.Decode = tt.want.Decode
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("Route mismatch (-want +got):\n%s", diff)
			}
		})
	}
}
