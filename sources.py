"""Where the samples come from: the shard list a --dataset_url names (local shards, remote http(s)/ftp ones, pipe:
commands, a plain folder of images in pseudo-shards), reading one shard's samples (remote ones through our own curl
call, whose waits are bounded), and the warnings a stream gives about what it could not read. data.py decodes,
crops and streams what this yields."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from collections import Counter
from typing import Iterator
from urllib.parse import urlparse

from common import redact

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm", "pgm", "pbm", "gif")
DIR_SHARD_SIZE = 256  # files per pseudo-shard when reading a plain directory


class DatasetError(RuntimeError):
    """A problem with the user's data that stops training; the message is one line."""


class SkipSample(Exception):
    """One sample that cannot be used (its reason a data.SKIP_REASONS entry): skipped and counted, never fatal."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# --------------------------------------------------------------------------------------------
# Shard lists
# --------------------------------------------------------------------------------------------
def is_remote(url: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", url)) or url.startswith("pipe:")


def image_files(root: str, exts: tuple[str, ...] = IMAGE_EXTS) -> list[str]:
    """The files under `root` with one of `exts` (images by default), in a stable order."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames.sort()
        for name in sorted(filenames):
            if name.rsplit(".", 1)[-1].lower() in exts and not name.startswith("."):
                files.append(os.path.join(dirpath, name))
    return files


def list_shards(url: str) -> list:
    """The shard list of a dataset: tar paths/URLs (str) or, for a directory, tuples of file paths.
    Raises DatasetError (one line) for an empty or missing local dataset."""
    import webdataset as wds
    if not url:
        raise DatasetError("no dataset given: pass --dataset_url (shards or a folder of images), or --demo")
    if os.path.isdir(url):
        files = image_files(url)
        if not files:
            tars = sorted(os.path.join(url, f) for f in os.listdir(url) if f.endswith(".tar"))
            if tars:  # a folder of shards: webdataset reads them by their names, not by their folder
                raise DatasetError(f"{url}: directory holds {len(tars)} .tar shards and no image files: give the shards "
                                   f"themselves, e.g. '{brace_url(tars)}' (quoted)")
            raise DatasetError(f"{url}: directory holds no image files ({', '.join(IMAGE_EXTS[:4])}, ...)")
        return [tuple(files[i:i + DIR_SHARD_SIZE]) for i in range(0, len(files), DIR_SHARD_SIZE)]
    try:
        shards = list(wds.shardlists.expand_urls(url))
    except Exception as e:
        raise DatasetError(f"cannot expand dataset url {url!r}: {e}") from None
    if not shards:
        raise DatasetError(f"dataset url {url!r} names no shard")
    local = [s for s in shards if not is_remote(s)]
    missing = [s for s in local if not os.path.isfile(s)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DatasetError(f"dataset shard not found: {missing[0]}{more}")
    return shards


def _pax_records(data: bytes) -> dict[bytes, bytes]:
    """The records of a pax extended header ("LEN key=value\\n" each)."""
    records, pos = {}, 0
    while pos < len(data) and data[pos:pos + 1] != b"\0":
        length = int(data[pos:data.index(b" ", pos)])
        key, _, value = data[data.index(b" ", pos) + 1:pos + length - 1].partition(b"=")
        records[key], pos = value, pos + length
    return records


def _tar_members(path: str) -> list[tuple[str, bool]] | None:
    """(name, is a regular file) of each member of an uncompressed tar, read one 512-byte header at a time, seeking
    over the data (a name from a pax header, as webdataset's writer puts before every member, or a GNU long-name
    header applies to the member after it); the members before a cut. None where tarfile must decide: compressed,
    a header that does not check, a global pax header, a sparse file."""
    members, length, name_for_next, size_for_next = [], os.path.getsize(path), None, None
    with open(path, "rb", buffering=0) as f:
        while len(header := f.read(512)) == 512 and header.count(0) < 512:
            stored = header[148:156].split(b"\0", 1)[0].strip()
            if not stored.isdigit() or int(stored, 8) != sum(header[:148]) + 256 + sum(header[156:]):
                return None
            kind, size = header[156:157], header[124:136].split(b"\0", 1)[0].strip()
            if kind in (b"g", b"S") or not size.isdigit():
                return None
            size = int(size, 8) if size_for_next is None or kind in (b"x", b"L", b"K") else size_for_next
            if f.tell() + size > length:
                break  # cut short: the stream's read of it fails
            if kind in (b"x", b"L", b"K"):
                data = f.read(size)
                f.seek(-(-size // 512) * 512 - size, 1)
                if kind == b"x":
                    records = _pax_records(data)
                    name_for_next = records.get(b"path", name_for_next)
                    size_for_next = int(records[b"size"]) if b"size" in records else size_for_next
                elif kind == b"L":
                    name_for_next = data.split(b"\0", 1)[0]
                continue
            name = header[:100].split(b"\0", 1)[0]
            if header[257:262] == b"ustar" and (prefix := header[345:500].split(b"\0", 1)[0]):
                name = prefix + b"/" + name
            name = (name_for_next if name_for_next is not None else name).decode("utf-8", "surrogateescape")
            members.append((name, kind in (b"0", b"\0", b"7") and not name.endswith("/")))
            name_for_next = size_for_next = None
            f.seek(-(-size // 512) * 512, 1)
    return members if members or len(header) == 512 else None  # a file shorter than a header: compressed?


def shard_size(shard) -> int | None:
    """The number of samples iter_shard yields from a local shard, counted from the tar headers alone (each member's
    data is skipped, not read), grouped as webdataset groups them; None for a remote shard (it would have to be
    downloaded); 0 for a local one that does not open (iter_shard yields nothing from it)."""
    if isinstance(shard, tuple):
        return len(shard)
    if is_remote(shard):
        return None
    from webdataset.tariterators import group_by_keys, meta_prefix, meta_suffix
    skip_meta = re.compile(r"__[^/]*__($|/)")  # tar_file_iterator's default

    def read_with_tarfile(mode: str, length: float) -> list[tuple[str, bool]]:
        members = []
        try:
            with tarfile.open(shard, mode=mode) as tar:
                for info in tar:
                    if info.offset_data + info.size > length:
                        break  # cut short: the stream's read of it fails
                    members.append((info.name, info.isreg()))
        except tarfile.ReadError:
            if not members and mode == "r:":  # compressed (.tar.gz): offsets are the uncompressed stream's
                return read_with_tarfile("r:*", float("inf"))
        except (tarfile.TarError, OSError, EOFError, ValueError):
            pass  # a truncated tar: iter_shard keeps the samples before the cut, and so does the count
        return members

    try:
        members = _tar_members(shard)
    except OSError:
        return 0
    if members is None:
        members = read_with_tarfile("r:", os.path.getsize(shard))
    files = ({"fname": name, "data": b"", "__url__": shard} for name, regular in members
             if regular and not ("/" not in name and name.startswith(meta_prefix) and name.endswith(meta_suffix))
             and not skip_meta.match(name))
    return sum(1 for _ in group_by_keys(files, handler=lambda exn: True))


# How long counting the shards' samples may take at start (each rank counts; a resume reads the saved counts);
# past it, the lanes start at whole shards
COUNT_BUDGET_S = 120.0


def shard_sizes(shards: list, budget_s: float | None = None) -> list[int] | None:
    """Every shard's sample count (shard_size), or None when one of them cannot be counted without downloading it,
    or counting takes longer than `budget_s` (COUNT_BUDGET_S)."""
    if any(not isinstance(shard, tuple) and is_remote(shard) for shard in shards):
        return None
    import time
    from concurrent.futures import ThreadPoolExecutor
    deadline = time.monotonic() + (COUNT_BUDGET_S if budget_s is None else budget_s)

    def count(shard) -> int | None:
        return shard_size(shard) if time.monotonic() < deadline else None
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(shards)))) as pool:
        sizes = list(pool.map(count, shards))
    return None if None in sizes else sizes


def brace_url(paths: list[str]) -> str:
    """'dir/{00000..00011}.tar' for consecutive shard paths written by write_shards."""
    if len(paths) == 1:
        return paths[0]
    head, first = os.path.split(paths[0])
    last = os.path.basename(paths[-1])
    m1, m2 = re.match(r"(.*?)(\d+)\.tar$", first), re.match(r"(.*?)(\d+)\.tar$", last)
    return os.path.join(head, f"{m1.group(1)}{{{m1.group(2)}..{m2.group(2)}}}.tar")


# --------------------------------------------------------------------------------------------
# Remote shards: curl with bounded waits
# --------------------------------------------------------------------------------------------
# webdataset opens these through curl with 30 retries and no read timeout: an unresolvable host stalls a
# worker for a minute per shard, a server that stops sending hangs the run for good. Here every wait is
# bounded; a shard that cannot be read is skipped, counted (data/skipped_shard_errors) and tried again next
# epoch. No curl retries: curl re-sends a retried transfer from its start into the same pipe.
CURL_SCHEMES = ("http", "https", "ftp", "ftps", "sftp", "scp")
CONNECT_TIMEOUT_S = 10  # to resolve and reach the host
STALL_TIMEOUT_S = 30  # with no byte received, before the first one or mid-transfer
PROBE_TIMEOUT_S = 30  # the start-up check of a remote dataset, all probes together


class CurlStream:
    """A remote shard streamed through curl. A failed transfer raises OSError with curl's own one-line reason
    at the point where the data stops, so the tar reader ends the shard there."""

    def __init__(self, url: str, max_time_s: float = 0):
        cmd = ["curl", "--fail", "--silent", "--show-error", "--location", "--connect-timeout", str(CONNECT_TIMEOUT_S),
               "--speed-limit", "1", "--speed-time", str(STALL_TIMEOUT_S)]
        if max_time_s:
            cmd += ["--max-time", str(max_time_s)]
        self.url, self.error = url, None
        self.proc = subprocess.Popen(cmd + [url], stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def read(self, size: int = -1) -> bytes:
        data = self.proc.stdout.read(size)
        if not data and size != 0 and self.proc.wait() != 0:  # the end of the data: a clean end or curl's error
            if self.error is None:
                lines = self.proc.stderr.read().decode(errors="replace").strip().splitlines()
                self.error = lines[-1] if lines else f"curl exited with status {self.proc.returncode}"
            raise OSError(self.error)
        return data

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # a shard left before its end (evaluation's image limit, the start-up probe)
        self.proc.stdout.close()
        self.proc.stderr.close()
        self.proc.wait()

    def __repr__(self) -> str:
        return f"<curl {redact(self.url)}>"


def open_shard(url: str):
    """A tar shard as a readable stream: curl (above) for curl's URL schemes, webdataset's gopen for the rest
    (local paths, pipe:..., and its other schemes)."""
    from webdataset.gopen import gopen, rewrite_url
    url = rewrite_url(url)  # webdataset's GOPEN_REWRITE mirrors, as gopen would apply them
    if urlparse(url).scheme in CURL_SCHEMES:
        return CurlStream(url)
    return gopen(url, "rb")


def probe_remote_shards(shards: list, probes: int = 3) -> tuple[str, bytes] | None:
    """At start-up: read the first tar header of up to `probes` remote shards (the first, middle and last), at
    the same time and within PROBE_TIMEOUT_S. DatasetError (one line) when none can be read: a dead host, a
    wrong URL or a missing credential is then an error at start, not a stall. Shards that fail later are
    skipped and counted. Returns (the first remote shard, its first tar header: with a pax header's, the blocks to
    the member's own) when that one was read (its first member's name says what kind of samples the dataset holds:
    run_setup.check_sample_kind), else None."""
    remote = [s for s in shards if isinstance(s, str) and urlparse(s).scheme in CURL_SCHEMES]
    if not remote:
        return None
    picks = sorted({0, len(remote) // 2, len(remote) - 1})[:probes]
    try:
        streams = [CurlStream(remote[i], max_time_s=PROBE_TIMEOUT_S) for i in picks]
    except OSError as e:  # no curl on this machine
        raise DatasetError(f"cannot run curl to read {redact(remote[0])} ({e})") from None
    reasons = []
    try:
        for i, stream in enumerate(streams):
            try:
                header = stream.read(512)
                if len(header) == 512:
                    return (remote[0], header + extended_header_rest(stream, header)) if i == 0 else None
                reasons.append(f"{stream.url}: shorter than a tar header")
            except OSError as e:
                reasons.append(f"{stream.url}: {e}")
    finally:
        for stream in streams:
            stream.close()
    tried = f"any of the {len(picks)} remote shards tried" if len(picks) > 1 else "the remote shard"
    raise DatasetError(f"cannot read {tried} ({redact(reasons[0])})")


def extended_header_rest(stream, header: bytes) -> bytes:
    """After a pax or GNU long-name tar header (the first member of a shard tarfile or webdataset wrote: a float
    mtime makes one), the blocks up to the first member's own header (in the same first packets); else nothing."""
    if header[156:157] not in (b"x", b"g", b"L", b"K"):
        return b""
    try:
        size = tarfile.TarInfo.frombuf(header, tarfile.ENCODING, "surrogateescape").size
        return stream.read(min(-(-size // 512) * 512, 8192) + 512)
    except (tarfile.TarError, OSError):
        return b""


def iter_shard(shard, counters: Counter, errors: list | None = None) -> Iterator[tuple[int, dict]]:
    """(sample index, sample) pairs of one shard; a sample maps lower-case extensions to bytes.
    A truncated or unreadable shard ends early and is counted; what was read before stands. `errors` collects
    (kind, reason) of what went wrong: "shard" (not fetched, or cut short) or "member" (a bad tar member)."""
    if isinstance(shard, tuple):
        for idx, path in enumerate(shard):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                counters["corrupt"] += 1
                continue
            yield idx, {"__key__": path, path.rsplit(".", 1)[-1].lower(): data}
        return
    from webdataset.tariterators import group_by_keys, tar_file_iterator

    def bad_member(exn: Exception) -> bool:
        counters["corrupt"] += 1
        if errors is not None:
            errors.append(("member", f"{shard}: {exn}"))
        return True

    def members(stream):
        # a truncated or unreadable tar ends the member stream normally, so that group_by_keys still
        # yields the last complete sample it holds
        try:
            for f in tar_file_iterator(stream, handler=bad_member):
                yield {**f, "__url__": shard}
        except (tarfile.TarError, OSError, EOFError, ValueError) as e:
            counters["shard_errors"] += 1
            if errors is not None:
                errors.append(("shard", f"{shard}: {e}"))
            warn_once(f"shard {shard}: {type(e).__name__}: {e} (skipping the rest of it)")

    try:
        stream = open_shard(shard)
    except (OSError, ValueError) as e:
        counters["shard_errors"] += 1
        if errors is not None:
            errors.append(("shard", f"{shard}: {e}"))
        warn_once(f"shard {shard}: {type(e).__name__}: {e}")
        return
    try:
        yield from enumerate(group_by_keys(members(stream), handler=bad_member))
    finally:
        try:
            stream.close()
        except Exception:
            pass


_warned: set[str] = set()  # what this process's stream has warned about (warn_once); forgotten when a stream starts


def forget_warnings() -> None:
    """A new stream (a new run, a resume) names each bad file once again (data.TrainStream calls it)."""
    _warned.clear()


def warn(msg: str) -> None:
    print(f"warning: {redact(msg)}", file=sys.stderr, flush=True)


def warn_once(msg: str, limit: int = 20) -> None:
    if msg in _warned or len(_warned) >= limit:
        return
    _warned.add(msg)
    warn(msg if len(_warned) < limit else "further data warnings suppressed")
