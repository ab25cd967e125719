"""The one vocabulary of causes: every cause a finding can name, with what it means and the
evidence that supports it. The diagnosis states one of them for every ring row; the audit
counts them, ``explain`` and the engine guards report them; a cause outside this enum is
refused where a :class:`~kvcanary.findings.diagnosis.Diagnosis` is made.

A ``Cause`` is a ``str`` (its name, e.g. ``"shared-slot"``): it compares, hashes, formats
and serialises as that name. Its ``templates`` are every sentence a finding states for it,
rendered by :meth:`Cause.render` from the evidence the audit's diagnosis or an engine guard
supplies (request ids, slot, block, step, allocator event); neither writes a sentence of its
own. A template is keyed by a view: what the evidence was seen from or which branch of the
diagnosis it is (``""`` the usual one; e.g. ``"write"`` the write row, ``"vllm"`` vLLM's
block pool, ``"zero-record"`` an all-zero record, ``"swap"`` a swapped mapping).

>>> Cause("shared-slot") is Cause.SHARED_SLOT, Cause.SHARED_SLOT == "shared-slot"
(True, True)
>>> Cause.SHARED_SLOT.name, Cause.SHARED_SLOT.description
('SHARED_SLOT', "two live requests map one slot: the record is the other request's")
>>> f"{Cause.NEVER_WRITTEN}: {Cause.NEVER_WRITTEN.evidence}"
'never-written: the stored record is all zeros'
>>> Cause.REMAPPED.render("history", request="req_1", block=7, step=3)
"req_1's block-table entry was changed to block 7 at step 3, which holds none of its content: the entry was remapped onto another block"
"""

from __future__ import annotations

import enum

# Fixed wordings a template takes as a field, the evidence choosing which (the audit's
# diagnosis adds REAL_KV_TOO where the real-KV hash fails beside another check).
REAL_KV_TOO = " The slot's real-KV bytes no longer match its record either."
OWN_RECORD = "this request's own"          # whose record a shifted mapping reads: a request's
CACHED_RECORD = "the same cached chain's"  # ... or a prefix-cache sweep entry's


class Cause(str, enum.Enum):
    """A cause: its name (the value), ``description`` (what happened) and ``evidence``
    (what in the row, the batch or the records supports it)."""

    def __new__(cls, name: str, description: str, evidence: str, templates=None):
        member = str.__new__(cls, name)
        member._value_ = name
        member.description = description
        member.evidence = evidence
        member.templates = dict(templates or {})
        return member

    def render(self, view: str = "", **evidence) -> str:
        """The sentence of template ``view`` with the ``evidence`` fields filled in
        (``str.format`` fields: ``request``, ``position``, ``slot``, ``block``, ``step``, ...).
        Raises ``KeyError`` naming the cause and the template or field it lacks."""
        if view not in self.templates:
            raise KeyError(f"cause {self.value} has no template {view!r} "
                           f"(it has: {', '.join(map(repr, self.templates)) or 'none'})")
        try:
            return self.templates[view].format(**evidence)
        except KeyError as exc:
            raise KeyError(f"cause {self.value}, template {view!r}: no evidence field "
                           f"{exc.args[0]!r}") from None

    # Shown as its name everywhere (str, format, repr, JSON), as causes were before the enum.
    __str__ = str.__str__
    __format__ = str.__format__
    __repr__ = str.__repr__

    OUT_OF_RANGE = ("out-of-range", "an index the launch read points outside its buffer or table",
                    "the slot or predecessor index lies outside the buffer or table", {
                        "table": "position {position} lies outside {table}: seq_len is larger "
                                 "than the table, or the request row is not in the table",
                        "buffer": "the table entry points outside the canary buffer (slot "
                                  "{slot}, the buffer has {num_slots} slots): a corrupt or stale "
                                  "{table} entry",
                        "buffer-unsized": "the table entry points outside the canary buffer "
                                          "(slot {slot}): a corrupt or stale {table} entry",
                        "real-kv-source": "slot {slot} lies past the rows of a real-KV source, "
                                          "so its KV bytes cannot be checked: the source is "
                                          "smaller than the canary buffer",
                        "predecessor": "the predecessor entry (position {previous}) points "
                                       "outside the canary buffer (slot {prev_slot})"})
    SLOT_ZERO = ("slot-zero", "a live prefix entry is mapped to padding slot 0 (kvcanary's "
                 "extension)", "a live prefix entry maps padding slot 0", {
                     "": "a live prefix entry is mapped to padding slot 0: the slot was never "
                         "assigned, or its mapping was cleared while the request still uses it "
                         "(lost write or premature free)",
                     "swa": "a live entry inside the sliding window maps to SWA slot 0: its SWA "
                            "slot was freed (full_to_swa_index_mapping holds 0) or never "
                            "assigned, or the table entry itself is 0",
                     "vllm": "{request} reads position {position} (group {group}) from vLLM's "
                             "null block 0: its block table names the null block where the "
                             "block holding that position belongs, so attention reads padding "
                             "instead of its KV"})
    NEVER_WRITTEN = ("never-written", "the slot was read before anything was written to it",
                     "the stored record is all zeros", {
                         "": "slot {slot} was never written this session, yet {request} reads "
                             "position {position} from it",
                         "zero-record": "slot {slot} holds an all-zero record: it was never "
                                        "written (a lost write: the token's KV and canary were "
                                        "skipped), or the buffer was captured before this "
                                        "step's write"})
    WRONG_BUFFER = ("wrong-buffer", "the launch read another buffer than the one written (or a "
                    "fresh one)", "the record is zero and so are most records the batch reads", {
                        "": "slot {slot} holds an all-zero record, and so do {zero_entries} of "
                            "the {checked_entries} live entries: the canary buffer checked is "
                            "not the one the engine writes (the wrong buffer, layer or group), "
                            "or it was captured before the writes"})
    SHARED_SLOT = ("shared-slot", "two live requests map one slot: the record is the other "
                   "request's", "another live request maps the slot, and the record is its own", {
                       "": "slot {slot} is also mapped by {owners}, and the stored record "
                           "(position {position}, token {stored_token}) is that request's: both "
                           "requests hold the slot — a double allocation, or the slot was freed "
                           "and reused while {reader} still references it.{real_kv}"})
    SHIFTED_MAPPING = ("shifted-mapping", "the request's slots are shifted or swapped between "
                       "its positions", "the record is another position of the same request", {
                           "shift": "{reader} reads slot {slot}, which holds {whose} record of "
                                    "position {position} (its chain continues this request's "
                                    "position {previous}): the mapping is shifted by "
                                    "{shift:+d} — "
                                    "the table entry for position {expected} points at the slot "
                                    "of position {position}.{real_kv}",
                           "swap": "{reader} reads slot {slot}, which holds {whose} record of "
                                   "position {position} (its chain continues this request's "
                                   "position {previous}): the mapping is swapped with position "
                                   "{position} (whose entry reads position {expected}'s "
                                   "record) — "
                                   "the table entry for position {expected} points at the slot "
                                   "of position {position}.{real_kv}",
                           "head-shift": "{reader} reads slot {slot}, which holds {whose} record "
                                         "of position {position} (its chain head, with this "
                                         "request's token): the mapping is shifted by "
                                         "{shift:+d} — the table entry for position {expected} "
                                         "points at the slot of position {position}.{real_kv}",
                           "head-swap": "{reader} reads slot {slot}, which holds {whose} record "
                                        "of position {position} (its chain head, with this "
                                        "request's token): the mapping is swapped with position "
                                        "{position} (whose entry reads position {expected}'s "
                                        "record) — the table entry for position {expected} "
                                        "points at the slot of position {position}.{real_kv}"})
    POSITION_CHANGED = ("position-changed", "the record's position was changed after the write",
                        "token and chain link are this entry's, only the position differs", {
                            "row": "slot {slot} holds position {position} with the token and "
                                   "chain link its reader expects, but not the expected "
                                   "position: the stored position changed after the "
                                   "write.{real_kv}",
                            "continues-own": "slot {slot} holds the record continuing position "
                                             "{previous} of this request's chain (its chain "
                                             "link), so it was written as position {written}, "
                                             "but it now says position {position}: the stored "
                                             "position changed after the write.{real_kv}",
                            "continues": "slot {slot} holds the record continuing position "
                                         "{previous} of {parents} (its chain link), so it was "
                                         "written as position {written}, but it now says "
                                         "position {position}: the stored position changed "
                                         "after the write.{real_kv}",
                            "": "slot {slot} holds position {position} where {reader} expects "
                                "{expected}, with the token and chain link of this entry: the "
                                "stored position changed after the write.{real_kv}",
                            "unchecked": "slot {slot} holds position {position} where {reader} "
                                         "expects {expected}, with the token (unchecked) and "
                                         "chain link of this entry: the stored position "
                                         "changed after the write.{real_kv}",
                            "unchecked-ambiguous": "slot {slot} holds position {position} where "
                                                   "{reader} expects {expected}, with the token "
                                                   "(unchecked) and chain link of this entry: "
                                                   "the stored position changed after the "
                                                   "write; without a token check this could "
                                                   "also be a record written at position "
                                                   "{position} by another sequence "
                                                   "(ambiguous).{real_kv}"})
    OVERWRITTEN = ("overwritten", "another sequence rewrote the slot while this request still "
                   "maps it", "the record belongs to no live request", {
                       "": "slot {slot} of {request} position {position} was overwritten by "
                           "{writer} (its position {writer_position}, step {writer_step}): the "
                           "block was freed or handed to another request while still "
                           "referenced, then reused",
                       "fork-share": "{request} shares block {block} with its parent {parent} "
                                     "since the fork at step {fork_step}{then}: the block was "
                                     "overwritten while {request} and {parent} still held "
                                     "it{why}",
                       "row": "slot {slot} holds a record of position {position} that is not "
                              "the one its reader expects (position and chain link differ): "
                              "the slot was rewritten by another sequence while still mapped (a "
                              "stale reuse or an evicted block), or the table maps a shifted, "
                              "swapped or doubly allocated slot — a log row alone cannot tell "
                              "these apart (ambiguous; `kvcanary audit` of a dump "
                              "cross-references the tables).{real_kv}",
                       "continues": "slot {slot} holds the record of position {position} "
                                    "continuing {parents}, not {reader}'s: the slot was "
                                    "rewritten for that sequence while this entry still maps it "
                                    "(a reuse while still referenced).{real_kv}",
                       "continues-cached": "slot {slot} holds the record of position {position} "
                                           "continuing {parents}, not {reader}'s: the slot was "
                                           "rewritten for that sequence while this entry still "
                                           "maps it (a reuse while still referenced) — or the "
                                           "cached chain's own record, displaced by a shifted or "
                                           "swapped block (no token check on a sweep entry tells "
                                           "them apart).{real_kv}",
                       "stale": "slot {slot} holds a record of position {position} that no live "
                                "request's chain continues, where {reader} expects position "
                                "{expected}: the slot was freed and rewritten by another "
                                "sequence while this request still maps it (a stale reuse, e.g. "
                                "an evicted block), or the table entry points at a stale "
                                "slot.{real_kv}",
                       "stale-window": "slot {slot} holds a record of position {position} that "
                                       "no live request's chain continues, where {reader} "
                                       "expects position {expected}: the slot was freed and "
                                       "rewritten by another sequence while this request still "
                                       "maps it (a stale reuse, e.g. an evicted block), or the "
                                       "table entry points at a stale slot (a sliding window "
                                       "leaves the record's predecessor unverified: a shift or "
                                       "a double allocation fits too).{real_kv}",
                       "stale-unchecked": "slot {slot} holds a record of position {position} "
                                          "that no live request's chain continues, where "
                                          "{reader} expects position {expected}: the slot was "
                                          "freed and rewritten by another sequence while this "
                                          "request still maps it (a stale reuse, e.g. an "
                                          "evicted block), or the table entry points at a "
                                          "stale slot (no records to cross-reference: a shift "
                                          "or a double allocation fits too).{real_kv}"})
    PREDECESSOR_CHANGED = ("predecessor-changed", "the previous position's record changed",
                           "only the chain link fails, and the predecessor's record fails too", {
                               "": "only the chain link of slot {slot} fails (token and "
                                   "position right) and {predecessor} has a finding of its own: "
                                   "the predecessor's record changed after this token was "
                                   "written; this row follows from that one.{real_kv}",
                               "unchecked": "only the chain link of slot {slot} fails (token "
                                            "and position right): the record at {predecessor} "
                                            "changed or was remapped after this token was "
                                            "written, or this record's own chain link was "
                                            "altered.{real_kv}"})
    LINK_CHANGED = ("link-changed", "the record's chain link changed",
                    "only the chain link fails, and the predecessor's record is intact", {
                        "": "only the chain link of slot {slot} fails (token and position "
                            "right) while the record at {predecessor} is intact: this record's "
                            "stored chain link changed after the write.{real_kv}",
                        "head": "the chain head at position {position} (slot {slot}) does not "
                                "start from the anchor: its chain link changed after the write, "
                                "or it was written as the continuation of another "
                                "sequence.{real_kv}",
                        "unverified-predecessor": "only the chain link of slot {slot} fails "
                                                  "(token and position right) and the record "
                                                  "at {predecessor} shows no finding, but its "
                                                  "own chain check could not run (its "
                                                  "predecessor's slot is freed): this record's "
                                                  "stored chain link changed after the write, "
                                                  "or the predecessor's did.{real_kv}"})
    KV_BYTES_CHANGED = ("kv-bytes-changed", "the slot's KV bytes changed after the write",
                        "only the real-KV hash fails", {
                            "": "the KV bytes of slot {slot} ({sources}) changed after they were "
                                "written; the record still matches token, position and chain: "
                                "the KV tensor was overwritten or corrupted in place",
                            "intact": "the real KV bytes of slot {slot} changed after its "
                                      "canary record was written (the record itself is "
                                      "intact): an in-place overwrite, a stray write into this "
                                      "slot, or a KV transfer/offload that changed the bytes",
                            "intact-group": "the real KV bytes of slot {slot} in the {cache} "
                                            "cache of the {group} group (launch tag "
                                            "{launch_tag}) changed after its canary record was "
                                            "written (the record itself is intact): an in-place "
                                            "overwrite, a stray write into this slot, or a KV "
                                            "transfer/offload that changed the bytes"})
    WRONG_TOKEN = ("wrong-token", "the slot holds another token than the one expected there",
                   "only the token fails against the expected tokens", {
                       "": "slot {slot} holds token {stored_token} where the request's history "
                           "has {expected_token} (position and chain link right): the KV of a "
                           "wrong token was written for this position — the class of a "
                           "speculative-decoding (EAGLE) draft/accept rotation bug.{real_kv}"})
    RECORD_CHANGED = ("record-changed", "several fields of the record changed",
                      "several fields of an otherwise unexplained record differ", {
                          "": "slot {slot} holds token {stored_token} where the request's "
                              "history has {expected_token}, and its chain link differs too: "
                              "the record was rewritten at the same position by other content "
                              "(a reuse by another sequence), or a wrong token was written after "
                              "a wrong predecessor.{real_kv}"})
    WRITE_INPUT = ("write-input", "the write path consumed other tokens or positions than "
                   "expected", "a write check failed against the expected inputs", {
                       "": "the forward consumed different input tokens or positions than "
                           "expected (write-path check)",
                       "seed": "the position id {position} is right, but the record before it "
                               "(this write's chain seed) holds position {seed_position}: an "
                               "earlier write of this request was lost, misplaced or "
                               "mis-positioned",
                       "position-id": "position ids off: the token at position {position} was "
                                      "written with position id {position_id}",
                       "input-id": "the forward's input id {stored_token} at position "
                                   "{position} is not the request's token {expected_token}",
                       "position": "slot {slot} holds the record {request} wrote for position "
                                   "{position} at step {step}, stored with position id "
                                   "{stored_position}: that write's position id was off by "
                                   "{offset:+d}",
                       "token": "slot {slot} holds the token {stored_token} that {request} "
                                "wrote for position {position} at step {step}, but the "
                                "request's token there is {expected_token}: its token ids and "
                                "positions disagree (an input id or the position offset is "
                                "off)"})
    UNKNOWN = ("unknown", "no known check failed", "only bits the diagnosis does not know", {
        "": "no check failed that the diagnosis knows"})

    # Causes only an engine guard names: from its block table, write indices and allocator.
    MISREAD = ("misread", "attention gathered a position from another slot than the block table "
               "maps", "the step's read indices differ from the block table", {
                   "": "misread: attention gathered position {position} of {request} from slot "
                       "{slot}, but the block table maps that position to slot {table_slot}; "
                       "the read indices are wrong (the write path is not involved)",
                   "successor": "the record of {request} position {position} is intact; its "
                                "chain link fails because this step gathered position "
                                "{previous} from a wrong slot (a misread)"})
    OFFSET_SHIFTED = ("offset-shifted", "the request's position offset is shifted: its tokens "
                      "went to the slots of neighbouring positions",
                      "the slot written (or read) is the block table's slot of the position "
                      "one before or after", {
                          "write": "the position offset of {request} is shifted by {shift:+d}: "
                                   "the token at position {position} was written with position "
                                   "id {engine_position} into the slot of position {shifted}",
                          "": "{request} wrote position {position} into the slot of position "
                              "{shifted}: its position offset was shifted by {shift:+d}, so "
                              "slot {slot} holds {holds}"})
    LOST_WRITE = ("lost-write", "the request's KV went to the engine's trash block",
                  "the write index names a slot of the trash blocks", {
                      "write": "lost write: the KV of {request} position {position} went to "
                               "the engine's trash block (slot {slot}) instead of slot "
                               "{table_slot}",
                      "": "lost write: {request} position {position} was written to the trash "
                          "block, so slot {slot} holds {holds}"})
    MISDIRECTED_WRITE = ("misdirected-write", "a write went to another slot than the block "
                         "table maps", "the write index differs from the block table's slot", {
                             "write": "misdirected write: {request} wrote position {position} "
                                      "into slot {slot}{victim} instead of its own slot "
                                      "{table_slot}",
                             "": "{request}'s write of position {position} was misdirected to "
                                 "slot {own_slot}, so its own slot {slot} holds {holds}",
                             "victim": "{writer} wrote its position {writer_position} into slot "
                                       "{slot} at step {writer_step}, a slot {request} still "
                                       "holds for position {position}: a misdirected write by "
                                       "{writer}"})
    REMAPPED = ("remapped", "the request's block-table entry was changed onto another block",
                "the request wrote the position elsewhere, or the allocator's history shows "
                "the entry changed to a block without its content", {
                    "": "{request} wrote position {position} to slot {own_slot} but now reads "
                        "it from slot {slot}, which holds {holds}: its block-table entry was "
                        "changed after the write (remapped onto another block)",
                    "history": "{request}'s block-table entry was changed to block {block} at "
                               "step {step}, which holds none of its content: the entry was "
                               "remapped onto another block"})
    FREED_WHILE_HELD = ("freed-while-held", "the block was freed while a request still held "
                        "it, then reused", "the allocator's free pool held the block while the "
                        "request's table did", {
                            "": "block {block} was freed at step {step} while {request} still "
                                "held it{then}: the block was freed while held and reused",
                            "fork-share": "block {block}, which {request} shares with its "
                                          "parent {parent} since the fork at step "
                                          "{fork_step}, was freed at step {step} while "
                                          "{request} still held it{then}: the block was freed "
                                          "while held and reused",
                            "vllm": "block {block} of {request} (position {position}, which it "
                                    "wrote itself) was handed to {writer}, which wrote its "
                                    "position {writer_position} there at step {writer_step} "
                                    "while {request} still maps the block: a block freed while "
                                    "still referenced, then reused ({pool})"})
    HANDED_TO_ANOTHER = ("handed-to-another", "the allocator handed the block to another "
                         "request while this one still held it", "a fresh allocation of the "
                         "block to another request while the reader's table held it", {
                             "": "block {block} was handed to {others} at step {step} while "
                                 "{request} still held it{then}",
                             "fork-share": "block {block}, which {request} shares with "
                                           "its parent {parent} since the fork at step "
                                           "{fork_step}, was handed to {others} at step {step} "
                                           "while {request} still held it{then}",
                             "cached": "{request} got block {block} from the prefix cache at "
                                       "step {since}; {writer} wrote its position "
                                       "{writer_position} there at step {writer_step}, while "
                                       "{request} still maps the block: an evicted cached block "
                                       "handed out to another request while a running request "
                                       "maps it ({pool})"})
    STALE_PREFIX_ENTRY = ("stale-prefix-entry", "a prefix-cache hit gave the request a block "
                          "whose content is no longer what its hash names", "the request got "
                          "the block from the prefix cache and its record is another's", {
                              "": "{request} got block {block} from the prefix cache at step "
                                  "{step} (its content hash matched {request}'s tokens){then}: "
                                  "a stale prefix-cache entry{why}",
                              "hash-differs": "{request} got block {block} from the prefix "
                                              "cache at step {step}, but the block's content "
                                              "hash is not that of {request}'s tokens there: a "
                                              "stale prefix-cache entry (the hash names a "
                                              "block that holds other content){why}"})
    PREFIX_COLLISION = ("prefix-collision", "two different prefixes map to one cached block",
                        "a prefix-cache hit on a block that holds another prefix's tokens", {
                            "vllm": "prefix-cache hash collision: {request} hit cached block "
                                    "{block} at step {since} for its positions {first}..{last}, "
                                    "but the block holds {writer}'s tokens (written at step "
                                    "{writer_step}), which differ from {request}'s: two "
                                    "different prefixes map to one cached block"})
    RESUMED_WRONG_BLOCKS = ("resumed-wrong-blocks", "a preempted request was resumed onto "
                            "blocks that are not its own", "the request was resumed onto the "
                            "block, which holds another request's record", {
                                "vllm": "{request} was resumed after preemption at step {since} "
                                        "onto block {block}, which holds {writer}'s position "
                                        "{writer_position} (written at step {writer_step}), not "
                                        "its own position {position}: a preempted request "
                                        "resumed onto the wrong blocks"})
    FORK_COPIED_WRONG_BLOCK = ("fork-copied-wrong-block", "a fork copied a block its parent "
                               "does not hold into the child", "the child's block is a fork's "
                               "copy of a block held by others", {
                                   "": "the fork of {parent} copied block {source} into "
                                       "{request}'s block {block}, but {parent} does not hold "
                                       "block {source} (held by {holders}): the fork copied "
                                       "another request's block"})
    CHANGED_AFTER_MOVE = ("changed-after-move", "the request holds the block by a legitimate "
                          "engine move, and the block changed after it", "the engine moved the "
                          "request's entry (prefix hit, de-duplication), and the record is "
                          "another's", {
                              "": "slot {slot} holds {holds}, not {request}'s position "
                                  "{position}; {request} reads it there since the engine moved "
                                  "its entry ({moved}), a legitimate move: what changed the "
                                  "block after that is the fault",
                              "held": "slot {slot} holds {holds}, not {request}'s position "
                                      "{position} ({request} holds the block by a legitimate "
                                      "move: {moved})"})
    FOREIGN_RECORD = ("foreign-record", "the slot holds a record that is not the reader's, and "
                      "the engine's bookkeeping names no reason", "the slot's last write was "
                      "another request's or another position's", {
                          "": "slot {slot} holds {holds}, not {request}'s position {position}"})
