//! Runs the fuzz harnesses without libFuzzer, on stable Rust: replays the seeds and any
//! saved corpus or crash files, then feeds mutated and random inputs for a while.
//!
//! ```text
//! replay [--seconds N] [--write-seeds DIR] [TARGET...]   (default: every target, 10 s each)
//! replay --target NAME FILE...                            (reproduce specific inputs)
//! ```
//!
//! No coverage feedback, so it finds less than libFuzzer; it exists so that CI on a
//! stable toolchain still exercises every invariant, and to reproduce crashes. A panic
//! saves the input under `fuzz/artifacts/<target>/` and exits non-zero; so does any
//! single allocation above 64 MiB (see `Guard`). The allocator also counts live bytes, for
//! the `server_session` harness's memory bound.

use std::alloc::{GlobalAlloc, Layout};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use usbwire_fuzz::{seeds, CountingAllocator, Harness, TARGETS};

/// No input is longer than 64 KiB, so no decoder has a reason to ask for more than this.
/// A larger request means an allocation sized from an unchecked length.
const MAX_ALLOCATION: usize = 64 << 20;
const MAX_INPUT: usize = 64 << 10;

struct Guard;

// SAFETY: forwards to the counting allocator (the system allocator underneath); refusing a request (null) is allowed and
// makes the standard library abort with "memory allocation of N bytes failed".
unsafe impl GlobalAlloc for Guard {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() > MAX_ALLOCATION {
            return std::ptr::null_mut();
        }
        // SAFETY: same contract as ours.
        unsafe { CountingAllocator.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { CountingAllocator.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > MAX_ALLOCATION {
            return std::ptr::null_mut();
        }
        // SAFETY: same contract as ours.
        unsafe { CountingAllocator.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GUARD: Guard = Guard;

/// The input being run, for the panic hook to save.
static CURRENT: Mutex<(String, Vec<u8>)> = Mutex::new((String::new(), Vec::new()));

fn main() -> ExitCode {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut args = std::env::args().skip(1);
    let mut seconds = 10u64;
    // Runs with the same pool and seed feed the same inputs; a long run split in
    // several gives each part its own seed (`--seed N`).
    let mut run_seed = 0u64;
    let mut targets = Vec::new();
    let mut files = Vec::new();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seconds" => seconds = args.next().and_then(|s| s.parse().ok()).unwrap_or(seconds),
            "--seed" => run_seed = args.next().and_then(|s| s.parse().ok()).unwrap_or(run_seed),
            "--write-seeds" => {
                let dir = PathBuf::from(args.next().unwrap_or_else(|| "seeds".into()));
                return write_seeds(&dir);
            }
            "--target" => targets.extend(args.next()),
            "-h" | "--help" => {
                eprintln!(
                    "usage: replay [--seconds N] [--seed N] [--write-seeds DIR] [TARGET...] | --target NAME FILE..."
                );
                return ExitCode::SUCCESS;
            }
            _ if TARGETS.iter().any(|(name, _)| *name == arg) => targets.push(arg),
            _ => files.push(PathBuf::from(arg)),
        }
    }
    if targets.is_empty() {
        targets = TARGETS.iter().map(|(name, _)| (*name).to_owned()).collect();
    }

    let default_hook = std::panic::take_hook();
    let artifacts = root.join("artifacts");
    std::panic::set_hook(Box::new(move |info| {
        if let Ok(current) = CURRENT.try_lock() {
            let (target, input) = &*current;
            let dir = artifacts.join(target);
            let path = dir.join(format!("crash-{:016x}", fnv1a(input)));
            if std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, input)).is_ok() {
                eprintln!(
                    "replay: input saved to {} (rerun: replay --target {target} {})",
                    path.display(),
                    path.display()
                );
            }
        }
        default_hook(info);
    }));

    for target in &targets {
        let Some(&(_, harness)) = TARGETS.iter().find(|(name, _)| name == target) else {
            eprintln!("replay: unknown target {target}");
            return ExitCode::FAILURE;
        };
        if !files.is_empty() {
            for file in &files {
                match std::fs::read(file) {
                    Ok(input) => run(target, harness, input),
                    Err(error) => {
                        eprintln!("replay: {}: {error}", file.display());
                        return ExitCode::FAILURE;
                    }
                }
            }
            println!("{target}: {} file(s) ok", files.len());
            continue;
        }
        let mut pool: Vec<Vec<u8>> = seeds::all().into_iter().filter(|s| s.target == target).map(|s| s.bytes).collect();
        for dir in ["seeds", "corpus", "artifacts"] {
            pool.extend(read_dir(&root.join(dir).join(target)));
        }
        for input in &pool {
            run(target, harness, input.clone());
        }
        let replayed = pool.len();
        let deadline = Instant::now() + Duration::from_secs(seconds);
        let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ fnv1a(target.as_bytes()) ^ run_seed.rotate_left(17));
        let mut executions = 0u64;
        while Instant::now() < deadline {
            for _ in 0..64 {
                let input = mutate(&mut rng, &pool);
                run(target, harness, input);
                executions += 1;
            }
        }
        println!("{target}: replayed {replayed} inputs, ran {executions} mutated inputs in {seconds} s, no failures");
    }
    ExitCode::SUCCESS
}

fn run(target: &str, harness: Harness, input: Vec<u8>) {
    let mut current = CURRENT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    current.0.clear();
    current.0.push_str(target);
    current.1 = input;
    let input = current.1.clone();
    drop(current);
    harness(&input);
}

fn read_dir(dir: &Path) -> Vec<Vec<u8>> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_file()).collect();
    paths.sort();
    paths.into_iter().filter_map(|p| std::fs::read(p).ok()).filter(|b| b.len() <= MAX_INPUT).collect()
}

fn write_seeds(dir: &Path) -> ExitCode {
    for seed in seeds::all() {
        let target_dir = dir.join(seed.target);
        let path = target_dir.join(format!("{}.bin", seed.name));
        if let Err(error) = std::fs::create_dir_all(&target_dir).and_then(|()| std::fs::write(&path, &seed.bytes)) {
            eprintln!("replay: {}: {error}", path.display());
            return ExitCode::FAILURE;
        }
        println!("{}", path.display());
    }
    ExitCode::SUCCESS
}

/// A mutated pool entry, or now and then plain random bytes.
fn mutate(rng: &mut Rng, pool: &[Vec<u8>]) -> Vec<u8> {
    if pool.is_empty() || rng.below(16) == 0 {
        let len = rng.below(256);
        return (0..len).map(|_| rng.byte()).collect();
    }
    let mut input = pool[rng.below(pool.len())].clone();
    for _ in 0..1 + rng.below(6) {
        let len = input.len();
        match rng.below(10) {
            0 if len > 0 => input[rng.below(len)] ^= 1 << rng.below(8),
            1 if len > 0 => input[rng.below(len)] = rng.byte(),
            // A 32-bit field (they are all aligned) set to a value that tends to matter.
            2 if len >= 4 => {
                const INTERESTING: [u32; 12] =
                    [0, 1, 2, 3, 4, 15, 16, 1024, 1025, 0x7fff_ffff, 0x8000_0000, 0xffff_ffff];
                let at = rng.below(len / 4) * 4;
                let value = INTERESTING[rng.below(INTERESTING.len())].to_be_bytes();
                input[at..at + 4].copy_from_slice(&value);
            }
            3 if len > 0 => input.truncate(rng.below(len)),
            4 if len > 0 => {
                let at = rng.below(len);
                let end = (at + 1 + rng.below(64)).min(len);
                input.drain(at..end);
            }
            5 => {
                let at = rng.below(len + 1);
                let bytes: Vec<u8> = (0..1 + rng.below(32)).map(|_| rng.byte()).collect();
                input.splice(at..at, bytes);
            }
            // Another entry appended (minus its control bytes, roughly): several
            // messages in one stream.
            6 => {
                let other = &pool[rng.below(pool.len())];
                input.extend_from_slice(other.get(3..).unwrap_or_default());
            }
            // A control byte: other chunking, limits, endpoint table or shape.
            7 if len > 0 => input[rng.below(len.min(8))] = rng.byte(),
            _ => {}
        }
    }
    input.truncate(MAX_INPUT);
    input
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}
