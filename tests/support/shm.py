"""DeepSpeed's /dev/shm buffers that ranks the tests kill on purpose cannot release themselves."""

from pathlib import Path

from train.main import SHM_BUFFER_NAME

SHM = Path("/dev/shm")
PATTERN = f"{SHM_BUFFER_NAME}_*"


def mapped_shm_files() -> set[str]:
    """/dev/shm files some live process maps: the buffers of ranks still running."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(maxsplit=5)[5].strip() for line in maps.read_text().splitlines()
                          if "/dev/shm/" in line)
        except (OSError, IndexError):  # the process ended, or a line without a path
            continue
    return mapped


def master_port(path: Path) -> int | None:
    """The MASTER_PORT in a buffer's name (SHM_BUFFER_NAME_<uid>_<addr>_<port>_<rank>)."""
    port = path.name.rsplit("_", 2)[-2] if path.name.count("_") >= 2 else ""
    return int(port) if port.isdigit() else None


def release_shm_buffers(ports_handed_out: set[int]) -> list[Path]:
    """Unlinks the unmapped buffers of the runs on these MASTER_PORTs, and says which. Only a session's own runs:
    another pytest-xdist worker's ranks may be creating theirs right now, and a buffer created but not yet mapped
    looks unused (a worker that ended first once unlinked a running rank's buffer, and its peer spun in
    shm_initialize until the test's timeout)."""
    in_use = mapped_shm_files()
    released = [path for path in SHM.glob(PATTERN)
                if master_port(path) in ports_handed_out and str(path) not in in_use]
    for path in released:
        path.unlink(missing_ok=True)
    return released
