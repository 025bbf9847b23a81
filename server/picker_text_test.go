package server

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
	"sigs.k8s.io/gateway-api-inference-extension/test/integration"

	"github.com/kvrouter/kvrouter/kvstate"
	"github.com/kvrouter/kvrouter/policy"
	"github.com/kvrouter/kvrouter/server/app"
	"github.com/kvrouter/kvrouter/server/frontdoor"
	"github.com/kvrouter/kvrouter/server/frontdoor/testmodels"
)

// The tests here send text prompts (completions text and chat messages) through the picker with
// real models' tokenizers and chat templates, loaded as kvrouter serve loads picker_models.

var pickerModels sync.Map // model name -> *frontdoor.Models holding it as "m"

// textModels returns the real model as the fleet's model "m".
func textModels(t *testing.T, model string) *frontdoor.Models {
	t.Helper()
	dir := testmodels.Dir(t, model)
	if m, ok := pickerModels.Load(model); ok {
		return m.(*frontdoor.Models)
	}
	m, err := frontdoor.LoadModels(map[string]string{"m": dir})
	if err != nil {
		t.Fatal(err)
	}
	actual, _ := pickerModels.LoadOrStore(model, m)
	return actual.(*frontdoor.Models)
}

// newTextFleet is a picker fleet whose model "m" is the real model.
func newTextFleet(t *testing.T, model string, withPrefill bool) *pickerFleet {
	t.Helper()
	models := textModels(t, model)
	return newPickerFleet(t, policy.DefaultConfig(), withPrefill, func(o *PickerOptions) { o.Models = models })
}

// decisionOf is what two routings of one prompt must agree on: the mode, both hops' workers and
// what they cache of it, and the prompt's size.
type decisionOf struct {
	Mode                        policy.Mode
	Reason                      policy.Reason
	PromptTokens, PromptBlocks  uint64
	Decode, Prefill             kvstate.WorkerKey
	DecodeOverlap, PrefillCache kvstate.TierCounts
}

func decisionFrom(o app.BookedOutcome) decisionOf {
	return decisionOf{Mode: o.Mode, Reason: o.Reason, PromptTokens: o.PromptTokens, PromptBlocks: o.PromptBlocks,
		Decode: o.Decode.Worker, Prefill: o.Prefill.Worker, DecodeOverlap: o.Decode.Overlap, PrefillCache: o.Prefill.Overlap}
}

// pickAndEnd sends one request through the picker, ends its stream once picked (the booking is
// freed as cancelled) and waits for the free; it returns the destination and the booking.
func (f *pickerFleet) pickAndEnd(path, body string) (string, app.BookedOutcome) {
	f.t.Helper()
	ctx, cancel := context.WithCancel(f.t.Context())
	got, err := integration.StreamedRequest(f.t, f.stream(ctx), integration.ReqRaw(postHeaders(path), body), 2)
	if err != nil || len(got) != 2 {
		cancel()
		f.t.Fatalf("responses = %v, %v", got, err)
	}
	if ir := got[0].GetImmediateResponse(); ir != nil {
		cancel()
		f.t.Fatalf("refused: %d %s", ir.GetStatus().GetCode(), ir.GetBody())
	}
	booked := f.freed.lastBooked()
	cancel()
	f.waitFreed(booked.RequestID)
	return destinationOf(got[0]), booked
}

func destinationOf(r *extprocv3.ProcessingResponse) string {
	return r.GetDynamicMetadata().GetFields()[destinationNamespace].GetStructValue().GetFields()[DefaultDestinationHeader].GetStringValue()
}

// waitFreed waits until the booking id has been freed.
func (f *pickerFleet) waitFreed(id string) {
	f.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		f.freed.mu.Lock()
		n := f.freed.freed[id]
		f.freed.mu.Unlock()
		if n > 0 {
			return
		}
		if time.Now().After(deadline) {
			f.t.Fatalf("booking %s was not freed", id)
		}
		time.Sleep(time.Millisecond)
	}
}

// routeIDs routes token ids straight through the dispatcher, as the Route RPC does, frees the
// booking, and returns it.
func (f *pickerFleet) routeIDs(id string, tokens []uint32) app.BookedOutcome {
	f.t.Helper()
	if _, err := f.d.Route(f.t.Context(), &app.Request{Request: policy.Request{ID: id, Model: "m", Tokens: tokens}}); err != nil {
		f.t.Fatalf("Route: %v", err)
	}
	booked := f.freed.lastBooked()
	if err := f.d.Free(f.t.Context(), id); err != nil {
		f.t.Fatalf("Free: %v", err)
	}
	return booked
}

// chatCase is a case of the chat goldens (frontdoor/chattemplate/testdata), with the token ids
// Hugging Face's apply_chat_template gives its prompt.
type chatCase struct {
	Name      string                     `json:"name"`
	Request   map[string]json.RawMessage `json:"request"`
	Synthetic *testmodels.Synth          `json:"synthetic"`
	WantIDs   []uint32                   `json:"want_ids"`
	RustIDs   []uint32                   `json:"rust_want_ids"`
	Digest    *testmodels.IDsDigest      `json:"want_ids_digest"`
}

func readChatCases(t *testing.T, model string) []chatCase {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("frontdoor", "chattemplate", "testdata", model+".golden.json"))
	if err != nil {
		t.Fatal(err)
	}
	var file struct{ Cases []chatCase }
	if err := json.Unmarshal(raw, &file); err != nil {
		t.Fatal(err)
	}
	return file.Cases
}

// body is the case's request as the client sends it, for model "m".
func (c chatCase) body(t *testing.T) string {
	t.Helper()
	return string(testmodels.ChatBody(t, "m", c.Request, c.Synthetic))
}

// referenceIDs are the case's prompt ids as Hugging Face makes them. A long case's golden holds
// only their digest: the front door's own ids stand in once they match it.
func (c chatCase) referenceIDs(t *testing.T, models *frontdoor.Models) []uint32 {
	t.Helper()
	if c.RustIDs != nil {
		return c.RustIDs
	}
	if c.WantIDs != nil {
		return c.WantIDs
	}
	if c.Digest == nil {
		t.Fatalf("%s: no ids in the golden", c.Name)
	}
	r, err := frontdoor.Parse(frontdoor.ChatCompletions, []byte(c.body(t)))
	if err != nil {
		t.Fatal(err)
	}
	ids, err := models.Tokens(r)
	if err != nil {
		t.Fatal(err)
	}
	if testmodels.DigestOf(ids) != *c.Digest {
		t.Fatalf("%s: the front door's %d ids are not the golden's %d", c.Name, len(ids), c.Digest.Count)
	}
	return ids
}

// TestPickerTextRoutesLikeTokenIDs: every chat golden of both models, sent through the picker
// as an OpenAI chat request, is routed exactly as Route routes Hugging Face's token ids for it:
// same mode, same workers, same overlap. Decode worker 2 caches two thirds of the prompt's
// blocks and worker 1 one third, so the overlap decides, and both must see it alike.
func TestPickerTextRoutesLikeTokenIDs(t *testing.T) {
	for _, model := range testmodels.Names {
		models := textModels(t, model)
		for _, c := range readChatCases(t, model) {
			ids := c.referenceIDs(t, models)
			blocks := len(ids) / pickerBlockSize
			if blocks < 6 {
				continue // too short for the overlap to decide
			}
			t.Run(model+"/"+c.Name, func(t *testing.T) {
				// No prefill worker: a disaggregated decision picks its decode worker by load,
				// where a tie is broken at random; here the overlap decides every decision.
				f := newTextFleet(t, model, false)
				f.cache(1, ids, blocks/3)
				f.cache(2, ids, 2*blocks/3)
				want := decisionFrom(f.routeIDs("route-"+c.Name, ids))
				dest, booked := f.pickAndEnd("/v1/chat/completions", c.body(t))
				if diff := cmp.Diff(want, decisionFrom(booked)); diff != "" {
					t.Errorf("picker's decision differs from Route's on the reference ids (-route +picker):\n%s", diff)
				}
				if want.Decode.ID != 2 || want.DecodeOverlap[kvstate.TierDevice] != uint64(2*blocks/3) || dest != pickerEndpoint(2) {
					t.Errorf("decode worker %d with %d blocks cached, destination %s; want worker 2 with %d, %s",
						want.Decode.ID, want.DecodeOverlap[kvstate.TierDevice], dest, 2*blocks/3, pickerEndpoint(2))
				}
			})
		}
	}
}

// TestPickerCompletionsTextRoutesLikeTokenIDs: a completions text prompt is routed as its token
// ids are (the tokenizer adds the model's BOS as vLLM does).
func TestPickerCompletionsTextRoutesLikeTokenIDs(t *testing.T) {
	const text = "Summarize the following report in three sentences.\n\n" +
		"The quarterly figures show revenue of $12.4M (up 8% year over year), driven by the EMEA region; " +
		"operating costs rose 3%, mostly from the new data centre in Frankfurt. Customer churn fell to 2.1%, " +
		"and the net promoter score reached 61, its highest since 2019. The board approved the hiring plan."
	for _, model := range testmodels.Names {
		t.Run(model, func(t *testing.T) {
			models := textModels(t, model)
			m, _ := models.Lookup("m")
			ids := m.Tokenizer.Encode(text, true)
			f := newTextFleet(t, model, false)
			f.cache(2, ids, len(ids)/pickerBlockSize)
			body, err := json.Marshal(map[string]any{"model": "m", "prompt": text})
			if err != nil {
				t.Fatal(err)
			}
			want := decisionFrom(f.routeIDs("route", ids))
			_, booked := f.pickAndEnd("/v1/completions", string(body))
			if diff := cmp.Diff(want, decisionFrom(booked)); diff != "" {
				t.Errorf("(-route +picker):\n%s", diff)
			}
			if want.Decode.ID != 2 || want.DecodeOverlap[kvstate.TierDevice] != uint64(len(ids)/pickerBlockSize) {
				t.Errorf("decode worker %d with %d blocks cached; want worker 2 with all %d", want.Decode.ID, want.DecodeOverlap[kvstate.TierDevice], len(ids)/pickerBlockSize)
			}
		})
	}
}

// conversation is a chat in turns: the system prompt, then user questions and the assistant's
// answers.
type conversation struct {
	system    string
	questions []string
	answers   []string
}

// messages is the request of turn n (0-based): every earlier question and answer, then question n.
func (c conversation) messages(n int) []map[string]string {
	msgs := []map[string]string{{"role": "system", "content": c.system}}
	for i := 0; i < n; i++ {
		msgs = append(msgs, map[string]string{"role": "user", "content": c.questions[i]},
			map[string]string{"role": "assistant", "content": c.answers[i]})
	}
	return append(msgs, map[string]string{"role": "user", "content": c.questions[n]})
}

// TestPickerMultiTurnChatFollowsItsCache: the second and third turns of a conversation land on
// the worker that served (and so caches) its earlier turns, though the other worker caches
// another conversation with the same system prompt; nothing but the cache ties them (no session
// header). The engine's cache is played as vLLM fills it: the prompt's tokens and the answer's,
// up to the end-of-turn token.
func TestPickerMultiTurnChatFollowsItsCache(t *testing.T) {
	system := "You are a concise travel assistant. Answer in at most two sentences, cite no sources, " +
		"and prefer metric units. If a question is ambiguous, answer the most likely reading."
	convs := []conversation{
		{system, []string{"What is the capital of France?", "And how many people live there?", "What river runs through it?"},
			[]string{"The capital of France is Paris.", "About 2.1 million people live in Paris proper, and 12 million in its metropolitan area.", ""}},
		{system, []string{"Name three rivers in Germany.", "Which of them is the longest?", "Where does it end?"},
			[]string{"The Rhine, the Elbe and the Danube.", "The Danube, at about 2,850 km, though most of it lies outside Germany.", ""}},
	}
	endOfTurn := map[string]string{"llama-3.1": "<|eot_id|>", "qwen3": "<|im_end|>"}
	for _, model := range testmodels.Names {
		t.Run(model, func(t *testing.T) {
			models := textModels(t, model)
			m, _ := models.Lookup("m")
			f := newTextFleet(t, model, false)
			encode := func(msgs []map[string]string) (string, []uint32) {
				body, err := json.Marshal(map[string]any{"model": "m", "messages": msgs})
				if err != nil {
					t.Fatal(err)
				}
				r, err := frontdoor.Parse(frontdoor.ChatCompletions, body)
				if err != nil {
					t.Fatal(err)
				}
				ids, err := models.Tokens(r)
				if err != nil {
					t.Fatal(err)
				}
				return string(body), ids
			}
			// Each conversation's first turn has been served by its own worker: conversation 0 by
			// worker 1, conversation 1 by worker 2, whose caches hold the prompt and the answer.
			cached := map[uint64][]uint32{} // the last conversation each worker served
			serve := func(worker uint64, prompt []uint32, answer string) {
				tokens := append(append(append([]uint32{}, prompt...), m.Tokenizer.Encode(answer, false)...), m.Tokenizer.Encode(endOfTurn[model], false)...)
				f.cache(worker, tokens, len(tokens)/pickerBlockSize)
				cached[worker] = tokens
			}
			for i, c := range convs {
				_, first := encode(c.messages(0))
				serve(uint64(i+1), first, c.answers[0])
			}
			for turn := 1; turn <= 2; turn++ {
				for i, c := range convs {
					body, ids := encode(c.messages(turn))
					dest, booked := f.pickAndEnd("/v1/chat/completions", body)
					worker := uint64(i + 1)
					if dest != pickerEndpoint(worker) || booked.Decode.Worker.ID != worker {
						t.Fatalf("conversation %d turn %d went to %s (worker %d), want %s: the worker that served its earlier turns",
							i, turn, dest, booked.Decode.Worker.ID, pickerEndpoint(worker))
					}
					// The prompt starts with the whole previous turn as the engine cached it, so the
					// overlap is every complete block of that.
					shared := 0
					for shared < len(ids) && shared < len(cached[worker]) && ids[shared] == cached[worker][shared] {
						shared++
					}
					if shared != len(cached[worker]) {
						t.Errorf("conversation %d turn %d: the prompt shares %d of the %d tokens its worker cached for the previous turn",
							i, turn, shared, len(cached[worker]))
					}
					if got, want := booked.Decode.Overlap[kvstate.TierDevice], uint64(shared/pickerBlockSize); got != want {
						t.Errorf("conversation %d turn %d: %d blocks cached on its worker, want %d", i, turn, got, want)
					}
					if turn == 1 {
						serve(worker, ids, c.answers[turn])
					}
				}
			}
		})
	}
}
