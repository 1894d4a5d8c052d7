{{/*
The parallel-config rules of pdserve/parallel_config.py (vLLM's rules plus pdserve's DCP-group rule), in the same
order and with the same messages, so the chart refuses at render time exactly what `pdserve validate` and the
services refuse. tests/deploy/test_helm_parallel_config.py compares every message with
pdserve.parallel_config.check_parallel_config over a grid of configurations; change both together.

"pdserve.modelError": ModelParallelInfo's refusals of an impossible model shape; "" when the shape is fine.
Argument: dict with "heads" "kv" (ints), "mla" (bool), "sw" (int, 0 = no sliding window).
*/}}
{{- define "pdserve.modelError" -}}
{{- $heads := int .heads -}}
{{- $kv := int .kv -}}
{{- if lt $heads 1 -}}
num_attention_heads must be a positive integer, got {{ $heads }}.
{{- else if lt $kv 1 -}}
num_kv_heads must be a positive integer, got {{ $kv }}.
{{- else if and (not .mla) (ne (mod $heads $kv) 0) -}}
num_attention_heads ({{ $heads }}) must be divisible by num_kv_heads ({{ $kv }}).
{{- else if lt (int .sw) 0 -}}
sliding_window must be a positive integer or None, got {{ int .sw }}.
{{- end -}}
{{- end -}}

{{/*
"pdserve.parallelError": the message of the first failing rule; "" when the config is valid.
Argument: dict with "heads" "kv" "sw" "tp" "dcp" "pp" "inter" "block" (ints; sw 0 = none) and "mla" (bool).
*/}}
{{- define "pdserve.parallelError" -}}
{{- $heads := int .heads -}}
{{- $kv := int .kv -}}
{{- $mla := .mla -}}
{{- $tp := int .tp -}}
{{- $dcp := int .dcp -}}
{{- $inter := int .inter -}}
{{- $block := int .block -}}
{{- $positive := list (list "--pipeline-parallel-size" (int .pp)) (list "--tensor-parallel-size" $tp) (list "--decode-context-parallel-size" $dcp) (list "--dcp-kv-cache-interleave-size" $inter) (list "--block-size" $block) -}}
{{- $bad := "" -}}
{{- range $positive -}}
{{- if and (not $bad) (lt (index . 1) 1) -}}
{{- $bad = printf "`%s` must be a positive integer (>= 1), got %d." (index . 0) (index . 1) -}}
{{- end -}}
{{- end -}}
{{- if $bad -}}
{{- $bad -}}
{{- else if ne (mod $tp $dcp) 0 -}}
tp_size={{ $tp }} must be divisible by dcp_size={{ $dcp }}.
{{- else if ne (mod $heads $tp) 0 -}}
Total number of attention heads ({{ $heads }}) must be divisible by tensor parallel size ({{ $tp }}).
{{- else if and (gt $dcp 1) (not $mla) (le $tp $kv) -}}
Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` ({{ $tp }}) to be greater than the model's total number of KV heads ({{ $kv }}). Increase `--tensor-parallel-size` or set `--decode-context-parallel-size 1`.
{{- else if and (gt $dcp 1) (not $mla) (gt $dcp (div $tp $kv)) -}}
`--decode-context-parallel-size` ({{ $dcp }}) exceeds the maximum supported value ({{ div $tp $kv }}) for `--tensor-parallel-size` ({{ $tp }}) and {{ $kv }} model KV heads.
{{- else if and (gt $dcp 1) (not $mla) (ne (mod (div $heads $kv) $dcp) 0) -}}
The model's number of query heads per KV head ({{ div $heads $kv }}) must be divisible by `--decode-context-parallel-size` ({{ $dcp }}) for GQA/MQA.
{{- else if and (gt $dcp 1) (not (and (le $inter $block) (eq (mod $block $inter) 0))) -}}
Block_size({{ $block }}) should be greater than or equal to and divisible by cp_kv_cache_interleave_size ({{ $inter }}).
{{- else if and (not $mla) (ne (mod $kv $tp) 0) (ne (mod $tp $kv) 0) -}}
The model's total number of KV heads ({{ $kv }}) cannot be split evenly across `--tensor-parallel-size` ({{ $tp }}) ranks: one of them must divide the other (vLLM's QKVParallelLinear refuses this at model load).
{{- else if and (gt $dcp 1) (not $mla) (ne (mod (div $tp $kv) $dcp) 0) -}}
`--decode-context-parallel-size` ({{ $dcp }}) must divide the number of TP ranks per KV head (`--tensor-parallel-size` {{ $tp }} // {{ $kv }} KV heads = {{ div $tp $kv }}) so that every decode context parallel group holds the same KV head.
{{- else if and (gt $dcp 1) (gt (int .sw) 0) -}}
DCP not support sliding window.
{{- end -}}
{{- end -}}

{{/* `pdserve validate` arguments for the same check (printed with a refusal, for the suggested fix) */}}
{{- define "pdserve.validateArgs" -}}
--num-attention-heads {{ int .heads }} --num-kv-heads {{ int .kv }}
{{- if .mla }} --use-mla{{ end }}
{{- if gt (int .sw) 0 }} --sliding-window {{ int .sw }}{{ end }} -tp {{ int .tp }} -dcp {{ int .dcp }} --dcp-kv-cache-interleave-size {{ int .inter }} --block-size {{ int .block }}
{{- end -}}

{{/* Fails the render on an impossible model shape or a refused prefill / decode parallel config. */}}
{{- define "pdserve.validate" -}}
{{- $m := .Values.model -}}
{{- $shape := dict "heads" $m.numAttentionHeads "kv" $m.numKvHeads "mla" $m.useMla "sw" ($m.slidingWindow | default 0) -}}
{{- $modelErr := include "pdserve.modelError" $shape -}}
{{- if $modelErr -}}
{{- fail (printf "model: %s (values: model.numAttentionHeads, model.numKvHeads, model.useMla, model.slidingWindow)" $modelErr) -}}
{{- end -}}
{{- $p := .Values.prefill -}}
{{- $prefill := merge (dict "tp" $p.tensorParallelSize "dcp" 1 "pp" 1 "inter" 1 "block" $p.blockSize) $shape -}}
{{- $err := include "pdserve.parallelError" $prefill -}}
{{- if $err -}}
{{- fail (printf "prefill: invalid parallel config: %s Check it, with a suggested fix: pdserve validate %s" $err (include "pdserve.validateArgs" $prefill)) -}}
{{- end -}}
{{- $d := .Values.decode -}}
{{- $decode := merge (dict "tp" $d.tensorParallelSize "dcp" $d.decodeContextParallelSize "pp" 1 "inter" $d.dcpKvCacheInterleaveSize "block" $d.blockSize) $shape -}}
{{- $err = include "pdserve.parallelError" $decode -}}
{{- if $err -}}
{{- fail (printf "decode: invalid parallel config: %s Check it, with a suggested fix: pdserve validate %s" $err (include "pdserve.validateArgs" $decode)) -}}
{{- end -}}
{{- end -}}
