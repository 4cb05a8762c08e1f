"""What NVML says about this rank's GPU: PCI bus id, NVLinks per peer GPU, P2P, PCIe link, NUMA node.

Uses the ``nvidia-ml-py`` package (``import pynvml``); on machines without it or without NVIDIA
GPUs, :func:`gpu_facts` returns ``None`` and discovery carries on without a link matrix. Every
NVML call that a GPU or driver does not support is skipped, not fatal: a fact it cannot read is
left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["gpu_facts", "normalize_bus_id"]


def normalize_bus_id(bus: str | bytes) -> str:
    """'00000000:19:00.0' and '0000:19:00.0' -> '0000:19:00.0' (lower case, 4-digit domain)."""
    text = bus.decode() if isinstance(bus, bytes) else bus
    text = text.strip().lower()
    domain, _, rest = text.partition(":")
    return f"{int(domain, 16):04x}:{rest}"


def _numa_of(bus: str) -> int | None:
    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus}/numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def gpu_facts(uuid: str | None = None, bus_id: str | None = None) -> dict[str, Any] | None:
    """NVML facts of the GPU with this UUID (or PCI bus id); None if NVML is unavailable."""
    try:
        import pynvml  # deferred: optional (commops[gpu]); loads the NVIDIA driver's library
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver / no GPU: discovery goes on without NVML
        return None
    try:
        if uuid:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        elif bus_id:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        else:
            return None
        mine = normalize_bus_id(pynvml.nvmlDeviceGetPciInfo(handle).busId)
        out: dict[str, Any] = {"bus_id": mine, "name": _text(pynvml.nvmlDeviceGetName(handle))}
        links: dict[str, int] = {}
        unknown = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) != pynvml.NVML_FEATURE_ENABLED:
                    continue
                peer = normalize_bus_id(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
            except pynvml.NVMLError:
                continue
            if peer.startswith("ffff"):  # hidden (virtual machines) or an NVSwitch: no GPU bus id
                unknown += 1
            else:
                links[peer] = links.get(peer, 0) + 1
        p2p = {cap: _p2p(pynvml, handle, mine, cap) for cap in ("READ", "NVLINK")}
        out["p2p_read"] = p2p["READ"]
        # Links whose far end NVML does not name go to every GPU it reports as an NVLink P2P peer:
        # the one GPU on the far end of direct links, or every GPU behind an NVSwitch (which is
        # how `nvidia-smi topo -m` shows them, e.g. NV18 between the two GPUs of a 2xH200 VM).
        if unknown:
            for bus, ok in p2p["NVLINK"].items():
                if ok:
                    links[bus] = links.get(bus, 0) + unknown
        out["nvlinks"] = links
        try:
            out["pcie"] = (f"gen{pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)} "
                           f"x{pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)}")
        except pynvml.NVMLError:
            pass
        numa = _numa_of(mine)
        if numa is not None:
            out["numa"] = numa
        return out
    except Exception:  # noqa: BLE001 - any NVML failure leaves the GPU facts out, never fails discovery
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _p2p(pynvml: Any, handle: Any, mine: str, cap: str) -> dict[str, bool]:
    """P2P status of ``cap`` (READ, NVLINK) from this GPU to every other GPU, by bus id."""
    index = getattr(pynvml, f"NVML_P2P_CAPS_INDEX_{cap}")
    index = index[0] if isinstance(index, tuple) else index  # some releases define 1-tuples (a stray comma)
    out = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        try:
            other = pynvml.nvmlDeviceGetHandleByIndex(i)
            bus = normalize_bus_id(pynvml.nvmlDeviceGetPciInfo(other).busId)
            if bus != mine:
                out[bus] = pynvml.nvmlDeviceGetP2PStatus(handle, other, index) == pynvml.NVML_P2P_STATUS_OK
        except Exception:  # noqa: BLE001 - NVMLError, or a binding that cannot pass the argument
            continue
    return out


def _text(x: str | bytes) -> str:
    return x.decode() if isinstance(x, bytes) else x
