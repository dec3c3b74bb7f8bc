// src/nvme/made_dirs.h — the directories tiermem makes for its swap spaces, and their removal by
// whichever engine is the last to leave them, so a closed engine leaves behind only what was there
// before it (a directory the user made stays, even when empty).
//
// A directory tiermem makes (an nvme_path that did not exist, or a missing parent of one) gets a
// marker file, kMadeMarker, inside: it says "made by tiermem, remove when empty". Every engine that
// uses such a directory — the one that made it or another rank or engine that found it — lists it,
// and when its swap space goes, removes it if nothing but the marker is left. The rank directory
// itself (<path>/rank<r>) is unmarked: one engine owns it and removes it (SwapSpace).
//
// Races between ranks that share a path, without locks: rmdir only ever removes an empty
// directory; a remover that finds the directory repopulated after it took the marker away puts the
// marker back (the directory is still tiermem's); a maker whose mkdir fails with ENOENT (a parent
// was just removed by an engine that closed) starts again from the top.
//
// Thread-safety: the functions are reentrant; concurrent callers in other processes are expected.
// Errors: make_marked_dirs throws IoError (path, errno) when a directory cannot be made;
// remove_if_unused never throws (what it cannot remove stays, logged at debug).
#pragma once

#include <string>
#include <vector>

namespace tiermem::detail {

inline constexpr const char* kMadeMarker = ".tiermem-made";

// Makes `dir` and its missing parents (mode 0700 for those made), then `dir`/`leaf` (0700).
// Returns the directories to hand to remove_if_unused when done, innermost first: `dir`/`leaf`
// when this call made it, then every directory on the way to `dir` (itself included) that carries
// the marker, whoever made it. `leaf` empty: `dir` is the last level. A leaf that exists already
// is listed when `dir` carries the marker (a killed run's rank directory inside tiermem's own).
std::vector<std::string> make_marked_dirs(const std::string& dir, const std::string& leaf);

// Removes `dir` when it holds nothing, or nothing but the marker (the marker then goes too). A
// directory that holds anything else, or is gone, stays as it is. Never throws.
void remove_if_unused(const std::string& dir) noexcept;

}  // namespace tiermem::detail
