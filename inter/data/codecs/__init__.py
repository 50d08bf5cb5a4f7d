"""Codecs: a gradient chunk into wire bytes and back (docs/design.md, "Rooms").

:mod:`.chain` builds a chain (``make_codec``) from :mod:`.spec`'s parse of ``sync.codec``
(torch-free, for the CLI); the stages are one module each: *tensor stages* turn a 1-D
float32 tensor (CPU or CUDA) into little-endian bytes and back (:mod:`.fp32`,
:mod:`.bf16`, :mod:`.int8` with :mod:`.int8_kernels`, :mod:`.int4`), *byte stages*
transform those bytes (:mod:`.shuffle`, :mod:`.zstd`); :mod:`.base` holds what they share.
:mod:`.speed` measures each on one core. This file imports nothing, so that the config
check reads a spec without torch.
"""
