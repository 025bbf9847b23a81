package trace

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"strconv"
	"time"
)

// azureLayout is the Azure traces' timestamp format: wall-clock time with 7 fractional digits (100
// ns), no zone. Parsing also takes fewer digits.
const azureLayout = "2006-01-02 15:04:05.9999999"

// azureHeader is the first line of an Azure LLM inference trace.
var azureHeader = []string{"TIMESTAMP", "ContextTokens", "GeneratedTokens"}

// LoadAzure reads an Azure LLM inference trace of 2023: CSV with the header
// TIMESTAMP,ContextTokens,GeneratedTokens and rows such as "2023-11-16 18:17:03.9799600,4808,10".
//
// The traces carry no prompt contents, so prompts share nothing: request i (counting rows from 0)
// has one segment of ContextTokens tokens whose key is derived from i alone. (Two Azure traces
// loaded separately therefore give equal prompts to equal row numbers; do not mix them in one
// replay.) Request i has ID "azure-i", Arrival its timestamp minus the first row's, OutputTokens
// GeneratedTokens, and no Session.
//
// Every row needs three fields, a timestamp in the layout above no earlier than the previous row's,
// and non-negative token counts. Errors name the line (counting from 1, the header being line 1)
// and the rule broken.
func LoadAzure(r io.Reader) ([]Request, error) {
	cr := csv.NewReader(r)
	cr.FieldsPerRecord = len(azureHeader)
	cr.ReuseRecord = true
	head, err := cr.Read()
	if errors.Is(err, io.EOF) {
		return nil, errors.New("trace: azure trace is empty, want the header TIMESTAMP,ContextTokens,GeneratedTokens")
	}
	if err != nil {
		return nil, fmt.Errorf("trace: azure %w", err)
	}
	for i, name := range azureHeader {
		if head[i] != name {
			return nil, fmt.Errorf("trace: azure line 1: column %d is %q, want %q", i+1, head[i], name)
		}
	}
	var (
		reqs        []Request
		first, prev time.Time
	)
	for {
		rec, err := cr.Read()
		if errors.Is(err, io.EOF) {
			return reqs, nil
		}
		if err != nil {
			// csv.ParseError already names the line.
			return nil, fmt.Errorf("trace: azure %w", err)
		}
		line, _ := cr.FieldPos(0)
		ts, err := time.Parse(azureLayout, rec[0])
		if err != nil {
			return nil, fmt.Errorf("trace: azure line %d: TIMESTAMP %q is not of the form %q", line, rec[0], azureLayout)
		}
		ctx, err := azureCount(rec[1])
		if err != nil {
			return nil, fmt.Errorf("trace: azure line %d: ContextTokens %w", line, err)
		}
		gen, err := azureCount(rec[2])
		if err != nil {
			return nil, fmt.Errorf("trace: azure line %d: GeneratedTokens %w", line, err)
		}
		if len(reqs) == 0 {
			first = ts
		} else if ts.Before(prev) {
			return nil, fmt.Errorf("trace: azure line %d: TIMESTAMP %s is before the previous row's %s",
				line, rec[0], prev.Format(azureLayout))
		}
		prev = ts
		i := len(reqs)
		reqs = append(reqs, Request{
			ID:           "azure-" + strconv.Itoa(i),
			Arrival:      ts.Sub(first),
			Segments:     appendSegment(nil, combine(tagAzure, uint64(i)), ctx),
			OutputTokens: gen,
		})
	}
}

// azureCount parses a token count of an Azure row.
func azureCount(field string) (int, error) {
	n, err := strconv.Atoi(field)
	if err != nil {
		return 0, fmt.Errorf("%q is not an integer", field)
	}
	if n < 0 {
		return 0, fmt.Errorf("%d is negative", n)
	}
	return n, nil
}
