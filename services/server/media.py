"""A chat request's images as a server reads them (vLLM's flags and their meaning): encoded bytes
in the request, or a URL — data:, file:// under --allowed-local-media-path, http(s) from
--allowed-media-domains (any domain when not set) within a timeout and a byte limit — decoded by
the model's image processor (engine/front/images.py). Errors name the image's field,
chat.messages[i].images[j]."""
from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass, field

import aiohttp

from baton.engine.common.errors import InvalidArgument, check
from baton.engine.front.images import ImageProcessor, data_url_bytes
from baton.services.rpc.chat import chat_images
from baton.v1 import generate_pb2 as pb


@dataclass(slots=True)
class MediaOptions:
    allowed_local_media_path: str | None = None  # file:// URLs under it are read; None: none are
    allowed_media_domains: list[str] = field(default_factory=list)  # http(s) hosts; empty: any
    limit_images: int = 4  # images in one request at most (--limit-mm-per-prompt '{"image": N}')
    fetch_timeout_s: float = 10.0
    max_image_bytes: int = 20 << 20

    def __post_init__(self):
        check(isinstance(self.limit_images, int) and self.limit_images >= 0, "limit_mm_per_prompt",
              f"image must be an integer >= 0, got {self.limit_images!r}")
        if self.allowed_local_media_path is not None:
            check(os.path.isdir(self.allowed_local_media_path), "allowed_local_media_path",
                  f"{self.allowed_local_media_path!r} is not a directory")


async def read_images(chat: pb.Chat, processor: ImageProcessor | None, options: MediaOptions) -> list:
    """Every message's images, in order, decoded (PIL images)."""
    fields = chat_images(chat)
    if not fields:
        return []
    check(processor is not None, "chat.messages.images", "this model takes no images (it is not a "
                                                         "vision-language model)")
    check(len(fields) <= options.limit_images, "chat.messages.images",
          f"has {len(fields)} images; this server takes at most {options.limit_images} in a request "
          f"(--limit-mm-per-prompt)")
    return [processor.decode(await _image_bytes(image, name, options), name) for name, image in fields]


async def _image_bytes(image: pb.Image, name: str, options: MediaOptions) -> bytes:
    kind = image.WhichOneof("source")
    check(kind is not None, name, "set data or url")
    if kind == "data":
        return image.data
    url = image.url
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme == "data":
        return data_url_bytes(url, name)
    if scheme == "file":
        return _local_file(urllib.parse.unquote(urllib.parse.urlsplit(url).path), name, options)
    check(scheme in ("http", "https"), name, f"URL scheme {scheme!r} is not read (data:, file://, http(s)://)")
    return await _fetch(url, name, options)


def _local_file(path: str, name: str, options: MediaOptions) -> bytes:
    root = options.allowed_local_media_path
    check(root is not None, name, "file:// URLs are not read: the server has no --allowed-local-media-path")
    real, base = os.path.realpath(path), os.path.realpath(root)
    check(os.path.commonpath([real, base]) == base, name, f"{path!r} is outside --allowed-local-media-path")
    check(os.path.isfile(real), name, f"{path!r} is not a file")
    check(os.path.getsize(real) <= options.max_image_bytes, name,
          f"is more than {options.max_image_bytes} bytes")
    with open(real, "rb") as f:
        return f.read()


async def _fetch(url: str, name: str, options: MediaOptions) -> bytes:
    host = urllib.parse.urlsplit(url).hostname or ""
    allowed = options.allowed_media_domains
    check(not allowed or host in allowed, name, f"host {host!r} is not in --allowed-media-domains")
    limit = options.max_image_bytes
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=options.fetch_timeout_s)) as session:
            async with session.get(url, allow_redirects=False) as response:
                check(response.status == 200, name, f"fetching it answered HTTP {response.status}")
                data = bytearray()
                async for chunk in response.content.iter_chunked(1 << 16):
                    data += chunk
                    check(len(data) <= limit, name, f"is more than {limit} bytes")
                return bytes(data)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise InvalidArgument(name, f"could not be fetched ({type(e).__name__}: {e})") from None
