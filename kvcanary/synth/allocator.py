"""The slot allocator: where slots are handed out and freed.

Full-pool slots come in pages of ``page_size`` slots. Page 0 holds padding slot 0 and is never
handed out. Free pages sit on a LIFO stack, so a freed page is the next one handed out and reuse
is frequent. Admission reserves the pages a request will need, so a running request never
starves. With a sliding window the canary group is the SWA pool: every written full slot also
takes an SWA slot (from a second LIFO stack), recorded in the full-to-SWA map ``lut``; 0 there
means "not resident".
"""

from __future__ import annotations

import numpy as np

from .config import SynthError


class SlotAllocator:
    def __init__(self, num_slots: int, page_size: int, swa: bool):
        self.page_size = ps = page_size
        self.num_pages = num_slots // ps
        self.num_full_slots = self.num_pages * ps
        self.free_pages = np.arange(self.num_pages - 1, 0, -1, dtype=np.int64)
        self.free_pages_top = self.num_pages - 1
        self.reserved_pages = 0
        if swa:
            self.lut = np.zeros(self.num_full_slots, dtype=np.int64)
            self.free_swa = np.arange(self.num_full_slots - 1, 0, -1, dtype=np.int64)
            self.free_swa_top = self.num_full_slots - 1
        else:
            self.lut = None
        # The SWA pool has as many slots as the full pool.
        self.num_canary_slots = self.num_full_slots

    @property
    def unreserved_pages(self) -> int:
        """Free pages not yet promised to an admitted request."""
        return self.free_pages_top - self.reserved_pages

    def pages_for(self, first: int, count: int) -> int:
        """New pages a request needs to write positions ``[first, first + count)``."""
        ps = self.page_size
        if count <= 0:
            return 0
        return (first + count - 1) // ps - (first - 1) // ps if first > 0 else \
            (count - 1) // ps + 1

    def canary_slots(self, full_slots: np.ndarray) -> np.ndarray:
        """The canary slots (SWA slots under a window) of full-pool slots."""
        return full_slots if self.lut is None else self.lut[full_slots]

    # ------------------------------------------------------------------ handing out

    def reserve(self, pages: int) -> None:
        self.reserved_pages += pages

    def release(self, pages: int) -> None:
        """Drop a reservation that will not be used (a finished request's leftover)."""
        self.reserved_pages -= pages

    def take_reserved_pages(self, n: int) -> np.ndarray:
        """Pop ``n`` pages that were reserved earlier."""
        if n > self.free_pages_top:
            raise SynthError("internal: the allocator ran out of pages despite reservations")
        top = self.free_pages_top
        pages = self.free_pages[top - n:top][::-1].copy()
        self.free_pages_top -= n
        self.reserved_pages -= n
        return pages

    def take_swa(self, full_slots: np.ndarray) -> np.ndarray:
        """Give each newly written full slot an SWA slot; returns the SWA slots."""
        n = int(full_slots.shape[0])
        top = self.free_swa_top
        slots = self.free_swa[top - n:top][::-1].copy()
        self.free_swa_top -= n
        self.lut[full_slots] = slots
        return slots

    # ------------------------------------------------------------------ freeing

    def free_slots(self, full_slots: np.ndarray) -> None:
        """Free page-aligned groups of full slots (and their resident SWA slots)."""
        if full_slots.size == 0:
            return
        if self.lut is not None:
            self.free_swa_of(full_slots)
        pages = np.unique(full_slots // self.page_size)
        n = int(pages.shape[0])
        if n:
            top = self.free_pages_top
            self.free_pages[top:top + n] = pages
            self.free_pages_top += n

    def free_swa_of(self, full_slots: np.ndarray) -> None:
        """Free the SWA slots of full slots that left a window (full slots stay allocated)."""
        swa = self.lut[full_slots]
        resident = swa != 0
        n = int(resident.sum())
        if n:
            top = self.free_swa_top
            self.free_swa[top:top + n] = swa[resident]
            self.free_swa_top += n
            self.lut[full_slots[resident]] = 0
