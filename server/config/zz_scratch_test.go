package config

import (
	"bytes"
	"fmt"
	"testing"
)

func TestZZScratch(t *testing.T) {
	for _, file := range []string{
		"conditional_disagg: true\nconditional_disagg_config:\n  eff_isl_ratio_threshold: .5\n",
		"conditional_disagg: true\nconditional_disagg_config:\n  eff_isl_threshold: +1\n",
		"conditional_disagg: true\nconditional_disagg_config:\n  eff_isl_threshold: 0x10\n",
		"conditional_disagg: true\nconditional_disagg_config:\n  eff_isl_threshold: 010\n",
		"conditional_disagg: true\nconditional_disagg_config:\n  eff_isl_threshold: 1_000\n",
		"conditional_disagg: true\nconditional_disagg_config:\n  eff_isl_ratio_threshold: .inf\n",
		"conditional_disagg: true\nconditional_disagg_config:\n  eff_isl_ratio_threshold: 5.\n",
		"conditional_disagg: true\nconditional_disagg_config:\n  policy: [a]\n",
		"conditional_disagg: true\nconditional_disagg_config:\n  policy: yes\n",
		"conditional_disagg: true\nconditional_disagg_config: {}\n",
		"conditional_disagg: true\nconditional_disagg_config: []\n",
		"listen: 127.0.0.1:1\n---\nbogus: 1\n",
		"a: 1\na: 2\n",
		"[a]: 1\n",
		"- 1\n",
		"~\n",
		"!!null {listen: x}\n",
		"listen: &x 127.0.0.1:5\nmetrics_listen: *x\n",
		"pprof: yes\n",
		"pprof: null\n",
		"max_prompt_tokens: 0x10\n",
		"max_prompt_tokens: 1e3\n",
		"listen: !!binary aGVsbG8=\n",
		"? listen\n",
	} {
		var stderr bytes.Buffer
		o, err := Load("kvrouter serve", nil, envFunc(map[string]string{"KVROUTER_CONFIG": writeFile(t, file)}), &stderr)
		if err != nil {
			fmt.Printf("%q\n   -> ERR %v\n", file, err)
			continue
		}
		fmt.Printf("%q\n   -> OK cd=%q listen=%q metrics=%q pprof=%v mpt=%d\n", file, o.ConditionalDisaggConfig, o.Listen, o.MetricsListen, o.Pprof, o.MaxPromptTokens)
	}
}
