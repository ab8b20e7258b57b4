"""Type stubs of the extension module `kiln._kiln` (the `kiln` package's Rust side)."""

from os import PathLike
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Sequence, Union, final

import numpy as np
import numpy.typing as npt

__version__: str

class KilnError(Exception):
    """A Kiln failure; the message is the command line's for the same failure."""

class InvalidRequestError(KilnError):
    """A request refused as `kiln-run serve` refuses it (a 4xx)."""

    param: Optional[str]
    status: int

def log_to_stderr(on: bool) -> None: ...

@final
class Request:
    """A generation in flight: iterate for the server's JSON answers."""

    def __iter__(self) -> Iterator[str]: ...
    def __next__(self) -> str: ...
    def cancel(self) -> None: ...

@final
class Model:
    def __new__(
        cls,
        path: Union[str, PathLike[str]],
        *,
        n_ctx: Optional[int] = None,
        threads: Optional[int] = None,
        n_batch: int = 512,
        n_parallel: int = 4,
        draft: Optional[Union[str, PathLike[str]]] = None,
        lookup: int = 0,
        cache_type: str = "f16",
        cache_mb: int = 256,
        verify: bool = True,
    ) -> "Model": ...
    @property
    def path(self) -> Path: ...
    @property
    def n_ctx(self) -> int: ...
    @property
    def n_vocab(self) -> int: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def metadata_json(self) -> str: ...
    def tokenize(self, text: str, add_special: bool = True) -> List[int]: ...
    def detokenize(self, tokens: Sequence[int]) -> str: ...
    def embed(
        self,
        input: Union[str, Sequence[str]],
        *,
        normalize: bool = True,
        truncate: bool = True,
        prompt_name: Optional[str] = None,
    ) -> npt.NDArray[np.float32]: ...
    def _request(self, kind: str, body: bytes) -> Request: ...
    def _health(self) -> str: ...
    def close(self) -> None: ...

_Path = Union[str, PathLike[str]]

def convert(
    src: _Path,
    dst: _Path,
    *,
    dtype: Optional[str] = None,
    dequantize_to: str = "f16",
    dequantize_all: bool = False,
    force: bool = False,
    allow_non_finite: bool = False,
) -> dict[str, Any]: ...
def quantize(
    src: _Path,
    dst: _Path,
    *,
    to: str,
    method: Optional[str] = None,
    calibrate: Optional[_Path] = None,
    calib_tokens: Optional[int] = None,
    calib_ctx: Optional[int] = None,
    importance: Optional[_Path] = None,
    save_importance: Optional[_Path] = None,
    bpw: Optional[float] = None,
    max_bytes: Optional[int] = None,
    keep: Sequence[str] = (),
    threads: Optional[int] = None,
    force: bool = False,
    progress: Optional[Callable[[int, int, str], object]] = None,
) -> dict[str, Any]: ...
def verify_layers(
    model: _Path,
    reference: _Path,
    *,
    max_nmse: Optional[float] = None,
    min_top1: Optional[float] = None,
    tolerance: Optional[str] = None,
    threads: Optional[int] = None,
    junit: Optional[_Path] = None,
    report: Optional[_Path] = None,
) -> dict[str, Any]: ...
