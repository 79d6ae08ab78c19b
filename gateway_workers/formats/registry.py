"""The format registry: chat template (by sha256) -> response format -> parser, plus operator overrides.

`detect_parser` recognises a tokenizer's chat template by the sha256 of its text (the real
templates as the model repos ship them; the tests hash the copies the trl wheel carries).
`--response-format NAME` overrides detection; NAME may also be `pkg.module:factory`, a
callable taking the tokenizer and returning a `ResponseParser`. An unknown template with no
format raises `ParserUnavailable` unless plain-text serving is allowed, which parses content only
and refuses tools. `resolve_format` runs the same decision without a tokenizer (the CLI's check
before it spawns workers). Must not import the app, adapters, engines or the backplane.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway_workers.formats.base import FormatParser, ResponseFormat
from gateway_workers.formats.chatml import NEMOTRON3, QWEN2_5, QWEN3, QWEN3_5
from gateway_workers.formats.deepseek import DEEPSEEK_R1
from gateway_workers.formats.gemma import GEMMA4
from gateway_workers.formats.glm import GLM4_MOE
from gateway_workers.formats.harmony import GPT_OSS
from gateway_workers.formats.legacy import SCHEMAS as LEGACY_SCHEMAS
from gateway_workers.formats.lfm import LFM2
from gateway_workers.formats.live_split import BufferedSplitter
from gateway_workers.formats.llama import LLAMA3_JSON
from gateway_workers.formats.muse import MUSE_GLIMMER
from gateway_workers.formats.parsed import LiveSplitter, ParsedResponse, ParserUnavailable, ResponseParser
from gateway_workers.formats.plain import PLAIN_FORMATS
from gateway_workers.formats.transformers_parsing import parsing_engine
from gateway_workers.rendering.tokenizer import builtin_template_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

PLAIN_TEXT = "plain"
FORMATS: dict[str, ResponseFormat] = {
    fmt.name: fmt
    for fmt in (
        QWEN3,
        QWEN2_5,
        QWEN3_5,
        NEMOTRON3,
        GLM4_MOE,
        GPT_OSS,
        LLAMA3_JSON,
        DEEPSEEK_R1,
        GEMMA4,
        LFM2,
        MUSE_GLIMMER,
        *PLAIN_FORMATS,
    )
}

# sha256 of a chat template's text (as transformers reads it: text mode, so '\r\n' becomes '\n')
# -> format name. Each entry is a model family's own template
# (trl ships byte-identical copies as chat_templates/<file>; `tests/unit/gateway_workers/formats/test_formats.py`
# hashes every one), plus trl's training variants of them, which parse the same.
TEMPLATE_FORMATS: dict[str, str] = {
    # qwen3.jinja, qwen3_training.jinja
    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8": "qwen3",
    "1d944ff8f268b611abb296cdd24d0f51981eef1c8647ac321c3a0258f61eb6c9": "qwen3",
    # qwen2_5.jinja, qwen2_5_training.jinja
    "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f": "qwen2_5",
    "0cd86fb80f520885e35040a8df321540e729d3358da41f27cf74d33103d94f62": "qwen2_5",
    # qwen3_instruct_2507.jinja, qwen3_instruct_2507_training.jinja
    "64f85b198065d0fba2a81f37e10ed68161ce2c19a754c7100e67e0ca2ee9c326": "qwen2_5",
    "48e17aa3caf5bf20075b6e7366864ee943e00b6f0752aadfe8b670c2ab0291a5": "qwen2_5",
    # qwen3_vl.jinja, qwen3_vl_training.jinja
    "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4": "qwen2_5",
    "66bd81986bf7f8abe6d7fb4a50341c8d8ae14b16637e8fb876bca7e7ef0b9c6f": "qwen2_5",
    # qwen3_5_think.jinja, qwen3_5_nothink.jinja and their training variants
    "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715": "qwen3_5",
    "273d8e0e683b885071fb17e08d71e5f2a5ddfb5309756181681de4f5a1822d80": "qwen3_5",
    "ccf356d8f238e287c047b1ef589850fd6b2b44e6cb29079e26c635fb9b8111ef": "qwen3_5",
    "f32fe3e21c20f59d193244181c8b4c324c73a8cd313ddf825633a9ecfd2afad2": "qwen3_5",
    # qwen3_6.jinja, qwen3_6_training.jinja
    "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259": "qwen3_5",
    "c5a26eaf3aab77fdc4ec696540ff896713ff0764f552ce9f597ede99fc673034": "qwen3_5",
    # qwen3_8.jinja, qwen3_8_training.jinja
    "c3cf9e34abf4f9e36c2d72165aa9c132d3e2a725b6c2586aaa3a8af9d7a81041": "qwen3_5",
    "320c2f734288f91c341c1c3c9690e4e6aba07a27852bf88d7c8481c880168288": "qwen3_5",
    # nemotron_3_nano / _super / _ultra / _5_lightning .jinja and their training variants
    "ab7813c3abdd9cb655905a410728b26c7884eca45ddfab8d9f931553485a7862": "nemotron3",
    "f52a4a70292b98db4d1b9f69a59546a43fc5e8603a6794781973a3e5821bd475": "nemotron3",
    "575fb74f54ed264df9047d0ecce3c98938aae953fb4f50356675706264cbb68a": "nemotron3",
    "d3859585444574090259d403ca65f71a496b77b0b50f31106aa99a25f5caa692": "nemotron3",
    "82753bef5cedc4932c1ed509b5c9a12be680fd86d1adb65bc3f7398d11c8eebc": "nemotron3",
    "d61cca230ac4f8137e74e88d73d8a649e4c3a71bb79b82925a19cf6dc52a6c7e": "nemotron3",
    "58933db77d3099b4f78c55a38347a72e1ea05b97d6bd8f38775303dc0194e0a9": "nemotron3",
    "a44efc49cf02e3dee4421bd34925ba7e2081f1652b16648efbec4a6e8a203ea8": "nemotron3",
    # glm4moe.jinja, glm4moe_training.jinja (that file has CRLF line ends; hashed as read: with '\n')
    "44f815868bf02fa458dd2f741a338046f4bf45f398eb6d067766726b9d96cce3": "glm4_moe",
    "18cbc5123073ee4a3253b729dcb00fef6665cba76ec86f3e6803db23ce85ca2f": "glm4_moe",
    # gptoss.jinja, gptoss_training.jinja
    "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146": "gpt_oss",
    "6adda7cea0f63ef14918be7f26100b324525b6185a8f06932914388ffaa52e32": "gpt_oss",
    # llama3_1.jinja, llama3_2.jinja
    "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65": "llama3_json",
    "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4": "llama3_json",
    # deepseek_r1_distill.jinja, deepseek_r1_distill_training.jinja
    "56a1447ad31926fdc21fb07e56e5642bd9c850c4f52d8c8af7bbe5f079a84f5f": "deepseek_r1",
    "439ca50e037bdf26b9e654e3eaa559fdd19d41e602307bcb133451070eb2ee3e": "deepseek_r1",
    # gemma4.jinja and its revisions gemma4_v2 .. gemma4_v5 (google/gemma-4-*-it)
    "33204f1acb5bd0002713e16a593847f24ceeafe711ed88bda2a352dc996a3373": "gemma4",
    "55572b8d3c8342044e25874c73fe5234b661fa0a57a57f6ef75b58e03d7d959a": "gemma4",
    "781d10940fbc44be40064b5d43a056fc486c84ceaa55538226368b57314132bf": "gemma4",
    "2f1b4d75d067bae3fe44e676721c7f077d243bc007156cb9c2f8b5836613d082": "gemma4",
    "0a2c8073c878ab1da004bee933a998606537bbb62016310352c7285c3f01c5b5": "gemma4",
    # lfm2_v2.jinja, lfm2_v2_training.jinja (LFM2 since it renders calls), lfm2_2_5 / _v2 / _vl.jinja (LFM2.5)
    "5504d163d879bfb6fd4135b7fa3d56768b2e69dd718338f7b146750289f46ab0": "lfm2",
    "fd9c5f7cb11511f72c3db43496380e4b40e7a6110a978dc27cf338ddec45efb2": "lfm2",
    "6d65c8804847ad74eea912dd7eca3dc1cf7a457b53a77f47d841a14121910963": "lfm2",
    "c5b67247c9f736f6c40eaa91ae1ef27dc67f5b041eedaadb97a1bea5030fb0ff": "lfm2",
    "86f4770449a4797c9b4212d110b0cc70fb993c1ce960095bcfb12eea22f61cca": "lfm2",
    # muse_glimmer.jinja, muse_glimmer_training.jinja (the ATEM protocol)
    "cfc67e5f349f37690dfd31ed1f18bc4442a9dd32fe39a648f993cb4eb3cae678": "muse_glimmer",
    "6eec84ccc527ef03efdcad19e64e5a4347d22c13c5d80fadcaf289ca3457ced9": "muse_glimmer",
    # Templates without tools, and their training variants: text only.
    # deepseekv3.jinja: the prompt opens <think> and earlier reasoning is dropped, as DeepSeek-R1's
    "563b1ce7d61d50a9b4c7439a912a1116f095b712df5b5e4d3e1116049874eb64": "deepseek_r1",
    "aadb4942004c186f9ba97d28f653d7f2e0dc20e4275352a486f7cafbe4dd7b51": "deepseek_r1",
    # gemma3.jinja, gemma.jinja (Gemma 1 and 2)
    "7de1c58e208eda46e9c7f86397df37ec49883aeece39fb961e0a6b24088dd3c4": "gemma3",
    "959b257e7fc1603f8cae9c9890e62f43d6ded6c0f72b9b73c4106a4ceaa096fc": "gemma3",
    "ecd6ae513fe103f0eb62e8ab5bfa8d0fe45c1074fa398b089c93a7e70c15cfd6": "gemma3",
    "f825de9ae80eac8a89fa5f9e6e80adf7b79ab8602564907e7c41dc15315d04ab": "gemma3",
    # phi3.jinja, phi3_5.jinja
    "dcaee66df77bfbb789ec541fe713218da30225a526f1db97138fc39ee6dc56aa": "phi3",
    "f00b774c5933129ee0a72bed355d9947cb09f8063d6cf23b7db71b33b5ea2162": "phi3",
    "78d976a442bcde2f0be15aafbb8e3050e1104f86732266f68403251b89982a90": "phi3",
    "a76a9651a9785afe269c6b91598d55f03ab8adf3d8489a4a9c8ef432128b7c08": "phi3",
    # cohere.jinja (Aya Expanse), cohere2.jinja (Tiny Aya)
    "90c33aee14aa2a226127516d48ee9184c9b90745d4a04c484621ec2e82fb712c": "cohere",
    "5f9718bfe3a1945366ea792b9714e42aa5849f1d41a1093c2ce4da4a77383996": "cohere",
    "2147c474f41b522b7296f74692b9f31e45f49a31465960576a9d321339c5915a": "cohere2",
    "7e5836a74c01d22504306273f8a7b49f944f6b960efee67609c07eef0a9ba295": "cohere2",
    # llama3.jinja (Llama 3.0)
    "ba03a121d097859c7b5b9cd03af99aafe95275210d2876f642ad9929a150f122": "llama3",
    "9dce981e2954cf77d4d0ad2dbacf8006a5fda34a0bdf4923075a933d08b69470": "llama3",
    # qwen2_5_vl.jinja (Qwen2-VL, Qwen2.5-VL)
    "a0bc6f6fc7a29a80017a433e8f03a1cc1236e838a944a2d034295a60c4f2fddb": "chatml",
    "31c85932a6d8826f0fe8d52b81767eba6b869128b0a7c7503d1e7baaad4e8043": "chatml",
}

ParserFactory = Callable[["PreTrainedTokenizerBase"], ResponseParser]
PARSER_FACTORIES: dict[str, ParserFactory] = {
    name: partial(FormatParser, fmt=fmt, legacy_schema=LEGACY_SCHEMAS.get(name)) for name, fmt in FORMATS.items()
}


def template_sha256(template: str) -> str:
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def known_templates() -> dict[str, str]:
    """TEMPLATE_FORMATS plus our built-in template (a Qwen3-style one, hashed from package data)."""
    return {template_sha256(builtin_template_text()): "qwen3", **TEMPLATE_FORMATS}


class PlainTextParser:
    """`--allow-plain-text` for an unknown template: the whole reply is content; tools are refused upstream.

    The engine's stop token is whatever the unknown template uses, so trailing special tokens are dropped.
    """

    format_name = PLAIN_TEXT
    supports_tools = False

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._special = set(tokenizer.all_special_ids)

    def parse(self, output_ids: Sequence[int], prefix: str | Sequence[int],
              tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedResponse:
        ids = list(output_ids)
        while ids and ids[-1] in self._special:
            ids.pop()
        text = self._tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return ParsedResponse(content=text if isinstance(text, str) else "".join(text))

    def live_splitter(self, prompt_text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> LiveSplitter:
        """An unknown template's replies stream at the end: nothing says where their parts begin."""
        return BufferedSplitter()


def _load_custom(path: str) -> ParserFactory:
    """`pkg.module:factory` -> the factory; the message says what is wrong with the path."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ParserUnavailable(f"custom parser {path!r} must be 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ParserUnavailable(f"cannot import the custom parser module {module_name!r}: {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ParserUnavailable(f"{module_name!r} has no callable {attr!r} (the custom parser factory)")
    return factory  # type: ignore[no-any-return]


def resolve_format(template: str | None, format_name: str | None = None, allow_plain_text: bool = False) -> str:
    """The format a worker with this chat template will parse with, or ParserUnavailable saying why none.

    Needs no tokenizer: the CLI calls it before it spawns workers, so `serve` refuses to start.
    """
    if format_name:
        if ":" in format_name:
            _load_custom(format_name)
        elif format_name != PLAIN_TEXT and format_name not in FORMATS:
            raise ParserUnavailable(
                f"unknown response format {format_name!r}; known: {sorted(FORMATS)} or 'package.module:factory'"
            )
        parsing_engine()  # fail now on a transformers without any parsing engine
        return format_name
    if not template:
        if allow_plain_text:
            return PLAIN_TEXT
        raise ParserUnavailable(
            "the tokenizer has no chat template, so its reply format is unknown; pass --response-format NAME "
            "(or --allow-plain-text to serve text without tool calls)"
        )
    digest = template_sha256(template)
    found = known_templates().get(digest)
    if found is not None:
        parsing_engine()
        return found
    if allow_plain_text:
        logger.warning(
            "unknown chat template (sha256 %s): serving plain text only; requests with tools get a 400", digest
        )
        return PLAIN_TEXT
    raise ParserUnavailable(
        f"unknown chat template (sha256 {digest}); no response parser is registered for it, and guessing "
        f"would mis-parse tool calls. Pass --response-format NAME (known: {sorted(FORMATS)}, or "
        "'package.module:factory' for your own parser), or --allow-plain-text to serve text without tool calls."
    )


def detect_parser(
    tokenizer: PreTrainedTokenizerBase, format_name: str | None = None, allow_plain_text: bool = False
) -> ResponseParser:
    """The parser for this tokenizer's chat template (recognised by sha256), or for `format_name` if given."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    name = resolve_format(template, format_name, allow_plain_text)
    if name == PLAIN_TEXT:
        return PlainTextParser(tokenizer)
    factory = _load_custom(name) if ":" in name else PARSER_FACTORIES[name]
    parser = factory(tokenizer)
    # A factory's parser is checked against the `ResponseParser` seam once, here, so the app reads its
    # capabilities as plain attributes on every turn.
    if not callable(getattr(parser, "parse", None)):
        raise ParserUnavailable(f"the parser from {name!r} has no parse(output_ids, prefix, tools) method")
    if not isinstance(getattr(parser, "format_name", None), str):
        raise ParserUnavailable(f"the parser from {name!r} has no format_name (a string)")
    if not isinstance(getattr(parser, "supports_tools", None), bool):
        raise ParserUnavailable(f"the parser from {name!r} has no supports_tools (a bool: can it parse tool calls?)")
    return parser


def template_from_dir(directory: str, chat_template_path: str | None = None) -> str | None:
    """The chat template a tokenizer directory carries (as transformers loads it), without loading the tokenizer."""
    if chat_template_path:
        return Path(chat_template_path).read_text("utf-8")
    root = Path(directory)
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text("utf-8")
    for name, key in (("chat_template.json", "chat_template"), ("tokenizer_config.json", "chat_template")):
        path = root / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text("utf-8")).get(key)
        if isinstance(value, list):  # named templates: transformers uses "default"
            value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
        if isinstance(value, str):
            return value
    return None
