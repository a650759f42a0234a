# The compiled module's interface (see _tcp_fast.pyx).
IDLE: int
HANDBACK: int
TIMEOUT: int
CLOSED: int
BROKEN: int
PROTOCOL: int

def last_errno() -> int: ...
def set_spin(seconds: float) -> None: ...
def spin() -> float: ...
def wait_readable(fd: int, seconds: float) -> bool: ...
def exchange(
    fd: int, op: int, rid: int, remote: int, local: int, n: int, deadline: float
) -> int | tuple[int, bytes]: ...
def serve(
    fd: int,
    lo: int,
    hi: int,
    rights: int,
    epoch_at: int,
    epoch: int,
    frame_timeout: float,
    min_rate: float,
    max_payload: int,
    hdr: bytearray,
) -> int: ...
