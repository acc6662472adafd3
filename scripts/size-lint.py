#!/usr/bin/env python3
"""Lists what breaks the workspace's size rules, and exits 1 if anything does:

* a non-test .rs file over 600 lines (lines inside `#[cfg(test)] mod … { … }`
  blocks are not counted; files under tests/ directories and files that are
  themselves `#[cfg(test)] mod x;` modules are skipped);
* a non-test fn over 100 lines, from its `fn` line to its closing brace.

A file whose module docs hold a line `//! size-exempt: WHY`, or a fn with a
`// size-exempt: WHY` line right above it (among its docs and attributes), is
allowed: WHY says which one concept needs the length (a per-message match, a
table). With --panics it also lists `.unwrap()` / `.expect(` outside tests,
for reading (they do not change the exit status).

Usage: scripts/size-lint.py [--panics] [ROOT]   (ROOT defaults to the repository)
"""
import os
import re
import sys

MAX_FILE_LINES = 600
MAX_FN_LINES = 100
SKIPPED_DIRS = {'target', '.git', 'tests', 'corpus', 'artifacts', 'node_modules'}
CFG_TEST_MOD = re.compile(
    r'#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*([{;])')
EXEMPT_FILE = re.compile(r'^\s*//! size-exempt: \S', re.M)
EXEMPT_FN = '// size-exempt: '


def blank(text):
    """`text` with everything but newlines turned into spaces."""
    return re.sub(r'[^\n]', ' ', text)


def mask(src):
    """The source with comments, strings and char literals blanked out (newlines kept),
    so that braces and `fn` in the result are code."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        after_ident = i > 0 and (src[i - 1].isalnum() or src[i - 1] == '_')
        if src.startswith('//', i):
            j = src.find('\n', i)
            j = n if j < 0 else j
            out.append(' ' * (j - i))
            i = j
        elif src.startswith('/*', i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith('/*', j):
                    depth, j = depth + 1, j + 2
                elif src.startswith('*/', j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(src[i:j]))
            i = j
        elif c in 'rb' and not after_ident and re.match(r'(?:r|br)#*"', src[i:i + 300]):
            m = re.match(r'(?:r|br)(#*)"', src[i:])
            close = '"' + m.group(1)
            j = src.find(close, i + len(m.group(0)))
            j = n if j < 0 else j + len(close)
            out.append(blank(src[i:j]))
            i = j
        elif c == 'b' and not after_ident and i + 1 < n and src[i + 1] in '"\'':
            out.append(' ')  # the literal itself is blanked by the branches below
            i += 1
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == '\\' else 1
            j += 1
            out.append(blank(src[i:j]))
            i = j
        elif c == "'":
            m = re.match(r"'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]{1,6}\}|.)|[^\\'\n])'", src[i:i + 16])
            if m:
                out.append(' ' * len(m.group(0)))
                i += len(m.group(0))
            else:  # a lifetime or a label
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return ''.join(out)


def closing_brace(code, open_at):
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] == '{':
            depth += 1
        elif code[j] == '}':
            depth -= 1
            if depth == 0:
                return j
    return len(code) - 1


def body_start(code, after):
    """Where the body of the fn whose name ends at `after` opens, or None for a fn without one."""
    depth = 0
    for j in range(after, len(code)):
        ch = code[j]
        if ch in '([':
            depth += 1
        elif ch in ')]':
            depth -= 1
        elif ch == ';' and depth == 0:
            return None
        elif ch == '{' and depth == 0:
            return j
    return None


def exempt_fn(lines, fn_line):
    """Whether a `// size-exempt:` line sits above line `fn_line` (1-based), past its docs and attributes."""
    k = fn_line - 2
    while k >= 0:
        text = lines[k].strip()
        if text.startswith(EXEMPT_FN):
            return True
        if text.startswith('///') or text.startswith('#[') or text.startswith('//'):
            k -= 1
            continue
        return False
    return False


def analyse(path):
    src = open(path, encoding='utf-8').read()
    code = mask(src)
    lines = src.split('\n')
    line_starts = [0]
    for m in re.finditer('\n', code):
        line_starts.append(m.end())

    def line_of(pos):
        lo, hi = 0, len(line_starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if line_starts[mid] <= pos:
                lo = mid
            else:
                hi = mid - 1
        return lo + 1

    test_lines, test_files = set(), []
    for m in CFG_TEST_MOD.finditer(code):
        if m.group(2) == '{':
            end = closing_brace(code, m.end() - 1)
            test_lines.update(range(line_of(m.start()), line_of(end) + 1))
        else:
            test_files.append(m.group(1))
    total = len(lines) - (1 if src.endswith('\n') else 0)
    long_fns = []
    for m in re.finditer(r'\bfn\s+(\w+)', code):
        start = line_of(m.start())
        if start in test_lines:
            continue
        opening = body_start(code, m.end())
        if opening is None:
            continue
        length = line_of(closing_brace(code, opening)) - start + 1
        if length > MAX_FN_LINES and not exempt_fn(lines, start):
            long_fns.append((m.group(1), start, length))
    panics = [(line_of(m.start()), lines[line_of(m.start()) - 1].strip())
              for m in re.finditer(r'\.(?:unwrap|expect)\(', code) if line_of(m.start()) not in test_lines]
    return {
        'counted': total - len(test_lines),
        'exempt': bool(EXEMPT_FILE.search(src)),
        'test_files': test_files,
        'long_fns': long_fns,
        'panics': panics,
    }


def child_module(path, name):
    """The file of module `name` declared in `path`, if there is one."""
    stem = os.path.basename(path)[:-3]
    parent = os.path.dirname(path) if stem in ('mod', 'lib', 'main') else path[:-3]
    for candidate in (os.path.join(parent, name + '.rs'), os.path.join(parent, name, 'mod.rs')):
        if os.path.exists(candidate):
            return candidate
    return None


def main(argv):
    show_panics = '--panics' in argv
    roots = [a for a in argv if not a.startswith('--')]
    root = roots[0] if roots else os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS)
        files += [os.path.join(directory, name) for name in sorted(names) if name.endswith('.rs')]
    results = {path: analyse(path) for path in files}
    test_modules = {child_module(path, name) for path, r in results.items() for name in r['test_files']}
    failures = 0
    for path, r in results.items():
        if path in test_modules:
            continue
        rel = os.path.relpath(path, root)
        if r['counted'] > MAX_FILE_LINES and not r['exempt']:
            print(f'{rel}: {r["counted"]} lines outside tests (at most {MAX_FILE_LINES}, or say why: //! size-exempt: WHY)')
            failures += 1
        for name, line, length in r['long_fns']:
            print(f'{rel}:{line}: fn {name} is {length} lines (at most {MAX_FN_LINES}, or say why: // size-exempt: WHY)')
            failures += 1
        if show_panics:
            for line, text in r['panics']:
                print(f'{rel}:{line}: outside tests: {text}')
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
