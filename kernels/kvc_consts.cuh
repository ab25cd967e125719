// SPDX-License-Identifier: Apache-2.0
// Constants of the canary format, shared by every kernel.
// kvcanary/consts.py holds the same values; tests/test_const_sync.py keeps them equal.
#pragma once

#include "kvc_types.cuh"

namespace kvc {

constexpr uint64_t kCanaryChainAnchor = 0xC0FFEE1234567890ULL;
constexpr int64_t kReqPoolIdxPadding = 0;
constexpr int64_t kTokenToKvSlotPadding = 0;

constexpr int64_t kCanaryFieldsPerSlot = 4;
constexpr int64_t kCanaryFieldToken = 0;
constexpr int64_t kCanaryFieldPosition = 1;
constexpr int64_t kCanaryFieldPrevHash = 2;
constexpr int64_t kCanaryFieldRealKvHash = 3;
constexpr int64_t kCanarySlotBytes = 32;

constexpr int64_t kViolationFields = 8;
constexpr int64_t kViolationFieldKernelKind = 0;
constexpr int64_t kViolationFieldSlotIdx = 1;
constexpr int64_t kViolationFieldPosition = 2;
constexpr int64_t kViolationFieldStoredToken = 3;
constexpr int64_t kViolationFieldExpectedToken = 4;
constexpr int64_t kViolationFieldStoredChainHash = 5;
constexpr int64_t kViolationFieldExpectedAux = 6;
constexpr int64_t kViolationFieldFailReasonBits = 7;
// The violation write index saturates here (INT32_MAX) instead of wrapping to negative.
constexpr int64_t kViolationWriteIndexMax = 0x7fffffff;

constexpr int64_t kMaxRealKvSources = 4;
constexpr int64_t kMaxRealKvSourcesLimit = 64;
constexpr int64_t kRealKvSourceFieldsPerEntry = 3;
constexpr int64_t kRealKvSourceFieldPageSize = 0;
constexpr int64_t kRealKvSourceFieldNumBytesPerToken = 1;
constexpr int64_t kRealKvSourceFieldReadBytes = 2;
constexpr int64_t kRealKvPartialReadBytes = 16;
constexpr int64_t kRealKvAlignBytes = 16;

constexpr int64_t kExpectedTokenUnknown = -1;
constexpr int64_t kPlanSlotOutOfTable = 0x7FFFFFFFFFFFFFFFLL;

constexpr uint64_t kSplitmix64Shift1 = 30;
constexpr uint64_t kSplitmix64Mul1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kSplitmix64Shift2 = 27;
constexpr uint64_t kSplitmix64Mul2 = 0x94D049BB133111EBULL;
constexpr uint64_t kSplitmix64Shift3 = 31;

enum class FailReason : int64_t {
  kVerifyChainHashMismatch = 1 << 0,
  kVerifyPositionMismatch = 1 << 1,
  kVerifyRealKvHashMismatch = 1 << 2,
  kWriteTokenMismatch = 1 << 3,
  kWritePositionMismatch = 1 << 4,
  kVerifyTokenMismatch = 1 << 5,
  kSlotOutOfRange = 1 << 6,
  kSlotZeroInPrefix = 1 << 7,
  kWriteSlotConflict = 1 << 8,
};

enum class RealKvHashMode : int32_t {
  kNone = 0,
  kPartial = 1,
  kAll = 2,
};

enum class LaunchTag : int32_t {
  kHeadKFull = 0,
  kHeadVFull = 1,
  kTailKFull = 2,
  kTailVFull = 3,
  kSweepKFull = 4,
  kSweepVFull = 5,
  kHeadKSwa = 6,
  kHeadVSwa = 7,
  kTailKSwa = 8,
  kTailVSwa = 9,
  kSweepKSwa = 10,
  kSweepVSwa = 11,
};

}  // namespace kvc
