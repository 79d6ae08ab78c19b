"""The rules of `request_fields`: every field and block type a request may carry, per dialect, with its verdict.

One table per dialect, in the order its rules apply (the first that matches a place decides); what each
verdict means, how a place is named, and the lookups are in `request_fields`. Pure data; imports only the
stdlib.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Verdict = Literal["honoured", "ignored", "refused", "hosted"]
Dialect = Literal["chat", "messages", "responses"]
H: Verdict = "honoured"
I: Verdict = "ignored"  # noqa: E741 -- one letter per verdict keeps the tables below readable
R: Verdict = "refused"
X: Verdict = "hosted"


@dataclass(frozen=True, slots=True)
class Rule:
    """One place of a request and its verdict; `extension`: a field the SDK types lack (another server's, a
    harness's, or one an older SDK had) that we take all the same."""

    pattern: str
    verdict: Verdict
    note: str = ""
    extension: bool = False


def _r(pattern: str, verdict: Verdict, note: str = "", extension: bool = False) -> Rule:
    return Rule(pattern, verdict, note, extension)


def _ignored(note: str, *patterns: str) -> tuple[Rule, ...]:
    return tuple(Rule(pattern, "ignored", note) for pattern in patterns)


_NOT_SAMPLED = "no effect on what the engine samples"
_CACHE = "prompt caching is the engine's (prefix caching): nothing to mark"
_REASONING = ("whether and how much the policy reasons is the trainer's choice (the chat template and the "
              "session's settings), not the harness's: accepted, not applied")
_HOSTED_ITEM = "an item of a hosted tool, which never runs here (a conversation from elsewhere)"
_PARALLEL = ("every call the model writes is returned and trained: `true` is what every reply does; `false` is "
             "accepted but not enforced")
_STRICT = "no constrained decoding: the arguments are what the model wrote, as with a model that ignores a schema"
_NO_IMAGES = "images and files are not served yet: a 400 naming the part"
_CUSTOM_TOOL = ("declared to the template as a function with one string parameter `input` (its format, a grammar "
                "or text, told in that parameter's description; not enforced); a call comes back as a custom call "
                "with that input")

CHAT: tuple[Rule, ...] = (
    _r("messages", H),
    _r("messages[developer]", H, "rendered as a system message"),
    _r("messages[system]", H, "rendered where it stands (see the fallback for templates that cannot)"),
    _r("messages[user]", H),
    _r("messages[assistant]", H, "its text, reasoning and calls are rendered as the chat template writes an "
       "assistant turn"),
    _r("messages[tool]", H, "rendered as the result of the call it answers (named after that call)"),
    _r("messages[function]", R, "the deprecated functions API is not served: declare `tools`"),
    _r("messages[*].role", H),
    _r("messages[tool].name", H, "the name of the tool that answered (the call's name when left out)",
       extension=True),
    _r("messages[*].name", I, "the chat templates have no place for a participant's name"),
    _r("messages[*].content", H, "a string, or text parts joined with newlines"),
    _r("messages[*].content[text]", H),
    _r("messages[*].content[refusal]", H, "its text is the message's text"),
    _r("messages[*].content[image_url]", R, _NO_IMAGES),
    _r("messages[*].content[input_audio]", R, "audio is not served"),
    _r("messages[*].content[file]", R, _NO_IMAGES),
    _r("messages[*].content[*].type", H),
    _r("messages[*].content[*].text", H),
    _r("messages[*].content[*].refusal", H),
    _r("messages[*].content[*].prompt_cache_breakpoint", I, _CACHE),
    _r("messages[assistant].reasoning_content", H, "vLLM's and SGLang's name for the reasoning, rendered as the "
       "template writes reasoning", extension=True),
    _r("messages[assistant].reasoning", H, "the same, by another name", extension=True),
    _r("messages[assistant].refusal", I, "the gateway's replies never carry one; the templates have no place for it"),
    _r("messages[assistant].audio", R, "audio is not served"),
    _r("messages[assistant].function_call", R, "the deprecated functions API is not served: use `tool_calls`"),
    _r("messages[assistant].tool_calls", H),
    _r("messages[assistant].tool_calls[function]", H),
    _r("messages[assistant].tool_calls[custom]", H, "a call of a custom tool: its input is the call's one argument"),
    _r("messages[assistant].tool_calls[*].id", H, "pairs each result with its call; not rendered"),
    _r("messages[assistant].tool_calls[*].type", H),
    _r("messages[assistant].tool_calls[*].function", H),
    _r("messages[assistant].tool_calls[*].function.name", H),
    _r("messages[assistant].tool_calls[*].function.arguments", H, "a JSON object string is rendered as the "
       "object the template iterates; any other text as text"),
    _r("messages[assistant].tool_calls[*].custom", H),
    _r("messages[assistant].tool_calls[*].custom.name", H),
    _r("messages[assistant].tool_calls[*].custom.input", H),
    _r("messages[tool].tool_call_id", H, "must answer an open call of the assistant message before"),
    _r("model", I, "one model is served; the reply names it"),
    _r("audio", R, "audio output is not served"),
    _r("modalities", H, "`[\"text\"]`; asking for audio is refused"),
    _r("frequency_penalty", H, "passed to the engine's sampling"),
    _r("presence_penalty", H, "passed to the engine's sampling"),
    _r("logit_bias", H, "passed to the engine's sampling (token ids of the served model's tokenizer, as vLLM "
       "reads them)"),
    _r("functions", R, "the deprecated functions API is not served: declare `tools`"),
    _r("function_call", R, "the deprecated functions API is not served: use `tool_choice`"),
    _r("logprobs", R, "`true` is refused: the sampled logprobs are recorded for training, not returned to agents; "
       "`false` is honoured"),
    _r("top_logprobs", R, "above 0 is refused (as `logprobs`)"),
    _r("max_completion_tokens", H),
    _r("max_tokens", H),
    _r("moderation", I, "no moderation runs here"),
    _r("n", H, "1; more choices are refused"),
    _r("parallel_tool_calls", H, _PARALLEL),
    _r("prediction", I, "predicted outputs only speed up decoding, they never change what is sampled"),
    *_ignored(_CACHE, "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention"),
    _r("reasoning_effort", I, _REASONING),
    _r("verbosity", I, "a hint to OpenAI's own models; nothing renders it"),
    _r("response_format", H, "`{\"type\": \"text\"}`"),
    _r("response_format[text]", H),
    _r("response_format[text].type", H),
    _r("response_format[*]", R, "JSON modes need constrained decoding"),
    *_ignored(_NOT_SAMPLED, "metadata", "safety_identifier", "service_tier", "user"),
    _r("store", I, "nothing is stored for OpenAI's distillation (every turn is recorded for training anyway)"),
    _r("seed", H, "passed to the engine's sampling"),
    _r("stop", H),
    _r("stream", H),
    _r("stream_options", H),
    _r("stream_options.include_usage", H),
    _r("stream_options.include_obfuscation", I, "no obfuscation padding is sent"),
    _r("temperature", H),
    _r("top_p", H),
    _r("top_k", H, "vLLM's and SGLang's sampling extension", extension=True),
    _r("min_p", H, "vLLM's and SGLang's sampling extension", extension=True),
    _r("repetition_penalty", H, "vLLM's and SGLang's sampling extension", extension=True),
    _r("chat_template_kwargs", I, "vLLM's and SGLang's extension (Qwen Code sends `enable_thinking: false` with its "
       "side requests): " + _REASONING, extension=True),
    _r("tool_choice", H, "`auto` (and null); `none`, `required`, a named tool and `allowed_tools` are refused: "
       "without constrained decoding the model's choice cannot be forced"),
    _r("tool_choice[*]", R, "a named tool or `allowed_tools`: without constrained decoding the model's choice "
       "cannot be forced"),
    _r("tools", H),
    _r("tools[function]", H),
    _r("tools[custom]", H, _CUSTOM_TOOL),
    _r("tools[*].type", H),
    _r("tools[*].function", H),
    _r("tools[*].function.name", H),
    _r("tools[*].function.description", H),
    _r("tools[*].function.parameters", H),
    _r("tools[*].function.strict", I, _STRICT),
    _r("tools[*].custom", H),
    _r("tools[*].custom.name", H),
    _r("tools[*].custom.description", H),
    _r("tools[*].custom.format", H, "told to the model in the `input` parameter's description, not enforced"),
    _r("tools[*].custom.format[*]", H),
    _r("tools[*].custom.format[*].*", H),
    _r("tools[*].custom.format[*].*.*", H),
    _r("web_search_options", X, "OpenAI's web search"),
)

MESSAGES: tuple[Rule, ...] = (
    _r("messages", H),
    _r("messages[user]", H),
    _r("messages[assistant]", H),
    _r("messages[system]", H, "rendered where it stands, as the chat template renders a system message there "
       "(templates that cannot: see the fallback)"),
    _r("messages[*].role", H),
    _r("messages[*].content", H, "a string or a list of blocks"),
    _r("messages[system].clear_at", H, "`next_user_message`: left out once a later user message exists"),
    _r("messages[system].output_config", I, _REASONING),
    _r("messages[*].content[text]", H),
    _r("messages[*].content[thinking]", H, "rendered as the template writes reasoning"),
    _r("messages[*].content[redacted_thinking]", I, "another provider's encrypted reasoning: nothing of it can be "
       "rendered"),
    _r("messages[*].content[tool_use]", H),
    _r("messages[*].content[tool_result]", H, "a tool message named after its call, in the block's order"),
    _r("messages[*].content[image]", R, _NO_IMAGES),
    _r("messages[*].content[document]", R, _NO_IMAGES),
    _r("messages[*].content[search_result]", R, "search results with citations are not served"),
    _r("messages[*].content[container_upload]", R, _HOSTED_ITEM),
    _r("messages[*].content[compaction]", R, "a summary Anthropic's server made and encrypted: not readable here"),
    _r("messages[*].content[tool_addition]", R, "tools declared mid-conversation have no place in the chat "
       "templates, which write every tool at the top"),
    _r("messages[*].content[tool_removal]", R, "as tool_addition"),
    _r("messages[*].content[fallback]", R, "a record of Anthropic's model fallback"),
    _r("messages[*].content[mcp_tool_listing]", R, _HOSTED_ITEM),
    _r("messages[*].content[server_tool_use]", R, _HOSTED_ITEM),
    _r("messages[*].content[mcp_tool_use]", R, _HOSTED_ITEM),
    _r("messages[*].content[mcp_tool_result]", R, _HOSTED_ITEM),
    _r("messages[*].content[*_tool_result]", R, _HOSTED_ITEM),
    _r("messages[*].content[*].type", H),
    _r("messages[*].content[*].text", H),
    _r("messages[*].content[*].thinking", H),
    _r("messages[*].content[*].signature", I, "only Anthropic can check it; the gateway's own say where the "
       "reasoning came from"),
    _r("messages[*].content[*].id", H, "pairs each result with its call; not rendered"),
    _r("messages[*].content[*].name", H),
    _r("messages[*].content[*].input", H),
    _r("messages[*].content[*].tool_use_id", H, "must answer a tool_use of the message before"),
    _r("messages[*].content[*].content", H, "a string or text blocks (other blocks are refused)"),
    _r("messages[*].content[*].content[text]", H),
    _r("messages[*].content[*].content[tool_reference]", H, "a tool a tool search found (Claude Code's ToolSearch): "
       "rendered as the tool's name, since every tool is declared up front"),
    _r("messages[*].content[*].content[*].text", H),
    _r("messages[*].content[*].content[*].type", H),
    _r("messages[*].content[*].content[*].tool_name", H),
    _r("messages[*].content[*].content[*].cache_control", I, _CACHE),
    _r("messages[*].content[*].content[*].citations", I, "citations are not served"),
    _r("messages[*].content[*].content[*]", R, _NO_IMAGES + "; text blocks only"),
    _r("messages[*].content[*].is_error", I, "the templates have no place for it: the result's text tells"),
    _r("messages[*].content[*].cache_control", I, _CACHE),
    _r("messages[*].content[*].citations", I, "citations are not served"),
    _r("messages[*].content[*].caller", I, "programmatic tool calling is hosted"),
    _r("messages[*].content[*].toolset_name", I, "toolsets are hosted"),
    _r("model", I, "one model is served; the reply names it"),
    _r("max_tokens", H),
    _r("stop_sequences", H),
    _r("stream", H),
    _r("temperature", H, "(older SDKs' field)", extension=True),
    _r("top_p", H, "(older SDKs' field)", extension=True),
    _r("top_k", H, "(older SDKs' field)", extension=True),
    _r("system", H, "a string or text blocks, rendered as the first system message"),
    _r("system[text]", H),
    _r("system[*].type", H),
    _r("system[*].text", H),
    _r("system[*].cache_control", I, _CACHE),
    _r("system[*].citations", I, "citations are not served"),
    _r("tools", H),
    _r("tools[custom]", H, "a tool without a `type` is one too"),
    _r("tools[*].type", H),
    _r("tools[*].name", H),
    _r("tools[*].description", H),
    _r("tools[*].input_schema", H),
    _r("tools[*].input_schema[object]", H, "an object schema, written as the template writes a function's "
       "parameters"),
    _r("tools[*].input_schema[object].*", H),
    _r("tools[*].cache_control", I, _CACHE),
    _r("tools[*].defer_loading", I, "every tool is declared up front, so nothing needs a tool search to load it"),
    _r("tools[*].strict", I, _STRICT),
    _r("tools[*].eager_input_streaming", I, "a tool call is streamed whole, once complete"),
    _r("tools[*].input_examples", I, "the templates have no place for examples"),
    _r("tools[*].allowed_callers", I, "programmatic tool calling is hosted"),
    *(_r(f"tools[{kind}]", X, "Anthropic's server tools (web search and fetch, code execution, tool search, MCP, "
         "advisor, browser and computer toolsets) and Anthropic-defined client tools (bash, text editor, computer, "
         "memory), whose schema and prompt only Anthropic has") for kind in (
        "web_search_*", "web_fetch_*", "code_execution_*", "tool_search_tool_*", "mcp_toolset", "advisor_*",
        "browser_toolset_*", "computer_*", "bash_*", "text_editor_*", "memory_*")),
    _r("mcp_servers", X, "MCP servers Anthropic's server would call"),
    _r("tool_choice", H),
    _r("tool_choice[auto]", H),
    _r("tool_choice[auto].type", H),
    _r("tool_choice[auto].disable_parallel_tool_use", H, _PARALLEL),
    _r("tool_choice[*]", R, "`any`, `tool` and `none` are refused: without constrained decoding the model's "
       "choice cannot be forced"),
    _r("thinking", I, _REASONING + "; a malformed one is refused as the API refuses it"),
    _r("output_config", H),
    _r("output_config.effort", I, _REASONING),
    _r("output_config.task_budget", I, "no budget is tracked"),
    _r("output_config.format", R, "structured outputs need constrained decoding"),
    _r("context_management", I, "no edits are applied: the model sees the conversation as sent (Claude Code's "
       "`clear_thinking` with `keep: all` changes nothing anyway)"),
    _r("compaction", R, "server-side compaction is not served"),
    _r("thread", R, "server-held threads are not served: send the whole conversation"),
    _r("container", I, "containers belong to the hosted code execution tool"),
    _r("cache_control", I, _CACHE),
    *_ignored(_NOT_SAMPLED, "metadata", "service_tier", "speed", "inference_geo", "diagnostics", "billing_policy"),
    _r("fallbacks", I, "no model fallback: one model is served"),
    _r("betas", I, "beta features are accepted as headers (`anthropic-beta`); none changes what is sampled"),
    *_ignored(_NOT_SAMPLED, "fallback_credit_token", "user_profile_id", "workspace_id"),
)

RESPONSES: tuple[Rule, ...] = (
    _r("input", H, "a string (one user message) or items"),
    _r("input[message]", H),
    _r("input[message].role", H, "`developer` and `system` are rendered as a system message"),
    _r("input[message].content", H),
    _r("input[message].content[input_text]", H),
    _r("input[message].content[output_text]", H),
    _r("input[message].content[refusal]", H, "its text is the message's text"),
    _r("input[message].content[input_image]", R, _NO_IMAGES),
    _r("input[message].content[input_file]", R, _NO_IMAGES),
    _r("input[message].content[*].type", H),
    _r("input[message].content[*].text", H),
    _r("input[message].content[*].refusal", H),
    _r("input[message].content[*].annotations", I, "citations are not served"),
    _r("input[message].content[*].logprobs", I, _NOT_SAMPLED),
    _r("input[message].content[*].prompt_cache_breakpoint", I, _CACHE),
    _r("input[message].type", H),
    _r("input[message].id", I, "items are not stored"),
    _r("input[message].status", I, _NOT_SAMPLED),
    _r("input[message].phase", I, "a label of OpenAI's own models' replies; nothing renders it"),
    _r("input[reasoning]", H, "rendered as the template writes reasoning"),
    _r("input[reasoning].type", H),
    _r("input[reasoning].content", H),
    _r("input[reasoning].content[reasoning_text]", H),
    _r("input[reasoning].content[*].type", H),
    _r("input[reasoning].content[*].text", H),
    _r("input[reasoning].summary", H, "its text stands for the reasoning when the item has no content"),
    _r("input[reasoning].summary[summary_text]", H),
    _r("input[reasoning].summary[*].type", H),
    _r("input[reasoning].summary[*].text", H),
    _r("input[reasoning].encrypted_content", I, "another provider's encrypted reasoning: nothing of it can be "
       "rendered"),
    _r("input[reasoning].id", I, "items are not stored"),
    _r("input[reasoning].status", I, _NOT_SAMPLED),
    _r("input[function_call]", H),
    _r("input[custom_tool_call]", H, "a call of a custom tool: its input is the call's one argument"),
    _r("input[function_call_output]", H, "rendered as the result of the call it answers"),
    _r("input[custom_tool_call_output]", H, "as function_call_output"),
    _r("input[*].type", H),
    _r("input[*].call_id", H, "pairs each output with its call; not rendered (an output without one names its tool "
       "instead, and is rendered as that tool's result: Codex sends its goal so)"),
    _r("input[*].name", H),
    _r("input[*].arguments", H),
    _r("input[*].input", H),
    _r("input[*].namespace", H, "a call of a namespaced tool: rendered under its flattened name "
       "(`namespace__name`)"),
    _r("input[*].output", H, "a string, or input_text parts (images and files are refused)"),
    _r("input[*].output[input_text]", H),
    _r("input[*].output[input_text].text", H),
    _r("input[*].output[input_text].type", H),
    _r("input[*].output[input_text].prompt_cache_breakpoint", I, _CACHE),
    _r("input[*].output[*]", R, _NO_IMAGES),
    _r("input[*].id", I, "items are not stored"),
    _r("input[*].status", I, _NOT_SAMPLED),
    _r("input[*].caller", I, "programmatic tool calling is hosted"),
    _r("input[*].async", I, "every call is answered before the next turn"),
    _r("input[item_reference]", R, "items are not stored: send the item itself"),
    _r("input[compaction]", R, "a summary OpenAI's server made and encrypted: not readable here"),
    _r("input[compaction_trigger]", R, "server-side compaction is not served"),
    _r("input[additional_tools]", R, "tools declared mid-conversation have no place in the chat templates"),
    _r("input[configuration_update]", R, "settings changed mid-conversation are not served"),
    *(_r(f"input[{kind}]", R, _HOSTED_ITEM) for kind in ("*_call", "*_call_output", "mcp_*", "tool_search_*",
                                                         "program*")),
    _r("instructions", H, "rendered as the first system message"),
    _r("max_output_tokens", H),
    _r("model", I, "one model is served; the reply names it"),
    _r("previous_response_id", H, "must name a committed response of the same session"),
    _r("stream", H),
    _r("stream_options", I, "no obfuscation padding is sent"),
    _r("temperature", H),
    _r("top_p", H),
    _r("top_logprobs", R, "above 0 is refused: the sampled logprobs are recorded for training, not returned"),
    _r("text", H),
    _r("text.format", H, "`{\"type\": \"text\"}`"),
    _r("text.format[text]", H),
    _r("text.format[text].type", H),
    _r("text.format[*]", R, "JSON modes need constrained decoding"),
    _r("text.verbosity", I, "a hint to OpenAI's own models; nothing renders it"),
    _r("tool_choice", H, "`auto` (and null); anything else is refused: without constrained decoding the model's "
       "choice cannot be forced"),
    _r("tool_choice[*]", R, "a named tool, a hosted tool or `allowed_tools`: without constrained decoding the "
       "model's choice cannot be forced"),
    _r("parallel_tool_calls", H, _PARALLEL),
    _r("max_tool_calls", I, "it bounds calls to hosted tools, which never run here"),
    _r("tools", H),
    _r("tools[function]", H),
    _r("tools[custom]", H, _CUSTOM_TOOL),
    _r("tools[namespace]", H, "its tools are declared as functions named `namespace__name`, and their calls come "
       "back under the namespace"),
    _r("tools[namespace].description", I, "the templates have no place for a group's description: each of its tools "
       "keeps its own"),
    _r("tools[*].type", H),
    _r("tools[*].name", H),
    _r("tools[*].description", H),
    _r("tools[*].parameters", H),
    _r("tools[*].format", H, "told to the model in the `input` parameter's description, not enforced"),
    _r("tools[*].format[*]", H),
    _r("tools[*].format[*].*", H),
    _r("tools[*].tools", H, "function and custom tools"),
    _r("tools[*].tools[function]", H),
    _r("tools[*].tools[custom]", H),
    _r("tools[*].tools[*].type", H),
    _r("tools[*].tools[*].name", H),
    _r("tools[*].tools[*].description", H),
    _r("tools[*].tools[*].parameters", H),
    _r("tools[*].tools[*].format", H),
    _r("tools[*].tools[*].format[*]", H),
    _r("tools[*].tools[*].format[*].*", H),
    _r("tools[*].tools[*].strict", I, _STRICT),
    _r("tools[*].tools[*].defer_loading", I, "every tool is declared up front"),
    _r("tools[*].tools[*].*", I, _NOT_SAMPLED),
    _r("tools[*].strict", I, _STRICT),
    _r("tools[*].defer_loading", I, "every tool is declared up front, so nothing needs a tool search to load it"),
    _r("tools[*].allowed_callers", I, "programmatic tool calling is hosted"),
    _r("tools[*].async", I, "every call is answered before the next turn"),
    _r("tools[*].output_schema", I, "the templates have no place for it"),
    *(_r(f"tools[{kind}]", X, "OpenAI's hosted tools (web and file search, code interpreter, image generation, "
         "computer use, MCP, tool search, programmatic tool calling) and tools whose schema only OpenAI has "
         "(local_shell, shell, apply_patch)") for kind in (
        "web_search*", "file_search", "code_interpreter", "image_generation", "computer*", "mcp", "tool_search",
        "programmatic_tool_calling", "local_shell", "shell", "apply_patch")),
    _r("include", I, "nothing extra is returned (no encrypted reasoning, search sources or logprobs)"),
    _r("reasoning", I, _REASONING),
    _r("truncation", I, "nothing is truncated: a prompt over the context budget is a 400"),
    _r("background", H, "false; background responses are refused"),
    _r("background_options", I, "background responses are refused anyway"),
    _r("conversation", R, "server-held conversations are not served: use previous_response_id or send the input"),
    _r("prompt", R, "stored prompt templates are not served"),
    _r("context_management", I, "no server-side compaction: the model sees the input as sent"),
    _r("store", I, "responses are kept for previous_response_id within their session whatever it says"),
    *_ignored(_NOT_SAMPLED, "metadata", "user", "service_tier", "safety_identifier", "access_programs"),
    *_ignored(_CACHE, "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention"),
    _r("moderation", I, "no moderation runs here"),
    _r("image", I, "options of the hosted image generation tool"),
    _r("client_metadata", I, "Codex CLI's request metadata", extension=True),
)
