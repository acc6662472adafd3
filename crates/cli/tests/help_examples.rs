//! Every example that names a bus id (`-b BUSID`, `--busid BUSID`, a
//! `--redir unix:PATH=BUSID`) in `usbwire --help`, each verb's `--help`, the
//! man pages and README.md's code blocks, against the servers a newcomer
//! would try them on: a real `usbwire demo` (keyboard 0-1, disk 0-2, serial
//! 0-3) and, for `bench`, which needs a bulk source and sink, `usbwire serve
//! --virtual loopback` (0-1). `demo --help` said `usbip attach -r 127.0.0.1
//! -b 1-1` while the demo exports 0-1…0-3 (issue 32).
//!
//! What can run here runs, with this test's host, port and socket paths in
//! place of the example's: `describe`, `redir` and `bench`. What cannot — a
//! kernel `attach` (vhci-hcd and root), `bind`/`unbind` (a real device of this
//! machine) — is checked for what it claims: a virtual device's bus id is one
//! the demo exports (bus 0), a real device's is a real shape and not on bus 0.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};

use usbwire_testing::process::{free_addr, scratch, start, Running};

const BIN: &str = env!("CARGO_BIN_EXE_usbwire");

fn usbwire(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

fn stdout(args: &[&str]) -> String {
    let out = usbwire(args);
    assert!(out.status.success(), "usbwire {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// One command line of an example that names a bus id.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Example {
    /// From `sudo`/`usbwire`/`usbip` on, split into words.
    words: Vec<String>,
    busid: String,
}

impl Example {
    /// The program (`usbwire` or `usbip`) and its verb.
    fn verb(&self) -> (&str, &str) {
        let at = self.words.iter().position(|w| w == "usbwire" || w == "usbip").unwrap_or(0);
        let verb = self.words[at + 1..].iter().find(|w| !w.starts_with('-')).map_or("", String::as_str);
        (self.words[at].as_str(), verb)
    }

    /// The words after `usbwire`, for running it.
    fn args(&self) -> Vec<String> {
        let at = self.words.iter().position(|w| w == "usbwire").expect("a usbwire command");
        self.words[at + 1..].to_vec()
    }

    fn line(&self) -> String {
        self.words.join(" ")
    }
}

/// A word of prose or code without the punctuation around it; of a usage
/// line's alternatives (`<BUSID>|--device`), the first.
fn bare(word: &str) -> &str {
    let punctuation = |c: char| "()[]<>`,;:'\"".contains(c);
    let word = word.trim_matches(punctuation);
    word.split('|').next().unwrap_or(word).trim_matches(punctuation).trim_end_matches('.')
}

/// The bus id in a `--redir unix:PATH=SELECTOR` word, when the selector is one (or a placeholder).
fn redir_busid(word: &str) -> Option<&str> {
    let (_, selector) = word.strip_prefix("unix:")?.rsplit_once('=')?;
    let busid_like = selector.contains('-') && selector.chars().all(|c| c.is_ascii_digit() || c == '-' || c == '.');
    (busid_like || selector.chars().all(|c| c.is_ascii_uppercase())).then_some(selector)
}

/// The commands on one line of text that name a bus id: each code span, and
/// the rest of the line, cut at `&&` and at a `#` comment.
fn examples_on(line: &str) -> Vec<Example> {
    let mut found = Vec::new();
    for span in line.split('`') {
        for piece in span.split("&&").flat_map(|piece| piece.split(" # ").next()) {
            let words: Vec<&str> = piece.split_whitespace().map(bare).filter(|w| !w.is_empty()).collect();
            let Some(start) = words.iter().position(|w| ["sudo", "usbwire", "usbip"].contains(w)) else { continue };
            let words = &words[start..];
            let flag = |pair: &&[&str]| (pair[0] == "-b" || pair[0] == "--busid") && !pair[1].starts_with('-');
            let named = words.windows(2).find(flag).map(|pair| pair[1]);
            if let Some(busid) = named.or_else(|| words.iter().find_map(|w| redir_busid(w))) {
                found.push(Example { words: words.iter().map(|w| (*w).to_owned()).collect(), busid: busid.to_owned() });
            }
        }
    }
    // `serve --help` gives `--redir`'s form in prose: (unix:/run/usbwire/redir.sock=0-2).
    if found.is_empty() {
        for word in line.split_whitespace().map(bare) {
            if let Some(busid) = redir_busid(word) {
                let words = ["usbwire", "serve", "--redir", word].map(str::to_owned).to_vec();
                found.push(Example { words, busid: busid.to_owned() });
            }
        }
    }
    found
}

/// A man page as text: roff's escapes and font changes taken out.
fn deroff(page: &str) -> String {
    page.replace("\\-", "-").replace("\\fB", "").replace("\\fR", "").replace("\\fI", "").replace("\\&", "")
}

/// README.md's fenced code blocks.
fn readme_code() -> String {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md")).unwrap();
    let mut code = String::new();
    let mut inside = false;
    for line in readme.lines() {
        if line.starts_with("```") {
            inside = !inside;
        } else if inside {
            code.push_str(line);
            code.push('\n');
        }
    }
    code
}

/// Every text a user reads examples in, by where it is: `--help` of the
/// program and each verb, each man page, README.md's code.
fn documentation(man_dir: &Path) -> Vec<(String, String)> {
    let program = stdout(&["--help"]);
    let verbs: Vec<String> = usbwire_testing::process::verbs_in_help(&program);
    assert!(verbs.len() > 20, "{verbs:?}");
    let mut texts = vec![("usbwire --help".to_owned(), program)];
    for verb in &verbs {
        texts.push((format!("usbwire {verb} --help"), stdout(&[verb, "--help"])));
    }
    stdout(&["man", "--dir", man_dir.to_str().unwrap()]);
    let mut pages: Vec<_> = std::fs::read_dir(man_dir).unwrap().map(|entry| entry.unwrap().path()).collect();
    pages.sort();
    assert!(pages.len() > 20, "{pages:?}");
    for page in pages {
        let name = page.file_name().unwrap().to_string_lossy().into_owned();
        texts.push((format!("man page {name}"), deroff(&std::fs::read_to_string(&page).unwrap())));
    }
    texts.push(("README.md".to_owned(), readme_code()));
    texts
}

/// Each example, once, with every place it is in.
fn collect(texts: &[(String, String)]) -> BTreeMap<Example, Vec<String>> {
    let mut examples: BTreeMap<Example, Vec<String>> = BTreeMap::new();
    for (source, text) in texts {
        for example in text.lines().flat_map(examples_on) {
            examples.entry(example).or_default().push(source.clone());
        }
    }
    examples
}

/// The collector finds what the documentation has, in every kind of source.
#[test]
fn the_collector_finds_bus_ids_in_help_prose_man_pages_and_code() {
    let line = "      then `sudo usbip attach -r 127.0.0.1 -b 0-1` (the keyboard) and `usbwire type hello`";
    assert_eq!(
        examples_on(line).iter().map(Example::line).collect::<Vec<_>>(),
        ["sudo usbip attach -r 127.0.0.1 -b 0-1"]
    );
    let line = "sudo modprobe vhci-hcd && sudo usbwire attach -r 192.168.1.5 --busid 0-2   # the disk";
    let found = examples_on(line);
    assert_eq!((found.len(), found[0].verb(), found[0].busid.as_str()), (1, ("usbwire", "attach"), "0-2"));
    let line = "          connects to a Unix socket only this user may open (unix:/run/usbwire/redir.sock=0-2), or to";
    assert_eq!(examples_on(line)[0].busid, "0-2");
    assert_eq!(
        deroff("\\fBusbwire describe \\-r 192.168.1.5 \\-b 1\\-1\\fR"),
        "usbwire describe -r 192.168.1.5 -b 1-1"
    );
    assert!(examples_on("usbwire list -p -l: busid=1-1#usbid=046d:c52b#").is_empty());
}

/// What an example is, for what it can be checked against.
#[derive(Debug, PartialEq, Eq)]
enum Kind {
    /// `BUSID`: a placeholder, not a bus id.
    Placeholder,
    /// `bind`/`unbind -b`: a real device of the machine the server runs on.
    RealDevice,
    /// `attach` (usbwire's or usbip's): into this kernel, through vhci-hcd, as root.
    Kernel,
    /// `bench -r`: a device with a bulk source and sink (the loopback device).
    Bench,
    /// Runs here against the demo: `describe`, `redir`.
    Runs,
    /// Names one of a server's devices otherwise (`serve --redir unix:PATH=BUSID`).
    Named,
}

fn kind(example: &Example) -> Kind {
    if example.busid.chars().all(|c| c.is_ascii_uppercase() || c == '_') {
        return Kind::Placeholder;
    }
    match example.verb() {
        (_, "bind" | "unbind") => Kind::RealDevice,
        (_, "attach") => Kind::Kernel,
        ("usbwire", "bench") => Kind::Bench,
        ("usbwire", "describe" | "redir") => Kind::Runs,
        _ => Kind::Named,
    }
}

/// `BUS-PORT[.PORT…]`, split: the bus, and whether the rest is ports.
fn shape(busid: &str) -> Option<&str> {
    let numbers = |part: &str| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit());
    let (bus, ports) = busid.split_once('-')?;
    (numbers(bus) && ports.split('.').all(numbers)).then_some(bus)
}

/// A started server: its address, and its devices' bus ids and kinds.
struct Server {
    _running: Running,
    addr: String,
    devices: Vec<(String, String)>,
}

impl Server {
    fn start(command: Command, ready: &str) -> Self {
        let running = start(command, ready).ready();
        let addr = running
            .printed()
            .iter()
            .find_map(|line| line.split_once("serving on ").map(|(_, addr)| addr.trim().to_owned()))
            .expect("the address it serves on");
        let list: serde_json::Value = serde_json::from_str(&stdout(&["list", "-r", &addr, "--json"])).unwrap();
        let devices = list["devices"]
            .as_array()
            .expect("devices")
            .iter()
            .map(|d| (d["busid"].as_str().unwrap().to_owned(), d["kind"].as_str().unwrap_or("").to_owned()))
            .collect();
        Self { _running: running, addr, devices }
    }

    fn has(&self, busid: &str) -> bool {
        self.devices.iter().any(|(b, _)| b == busid)
    }

    /// The example's words after `usbwire`, its `-r` this server.
    fn aimed(&self, example: &Example) -> Vec<String> {
        let mut args = example.args();
        if let Some(at) = args.iter().position(|w| w == "-r" || w == "--remote") {
            args[at + 1] = self.addr.clone();
        }
        args
    }
}

fn run(args: &[String]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

/// `describe` and `redir`, run as written but against the demo.
fn runs_against_the_demo(example: &Example, demo: &Server, dir: &Path) -> Result<(), String> {
    let mut args = demo.aimed(example);
    match example.verb().1 {
        "describe" => {
            let out = run(&args);
            let printed = String::from_utf8_lossy(&out.stdout);
            if !out.status.success() || !printed.contains(&format!("Device {}", example.busid)) {
                return Err(format!("{args:?}: {}{printed}", String::from_utf8_lossy(&out.stderr)));
            }
        }
        _ => {
            // redir: its guest socket in this test's directory; up and listening is what is checked.
            let at = args.iter().position(|w| w == "--listen").ok_or("redir without --listen")?;
            args[at + 1] = format!("unix:{}", dir.join("redir.sock").display());
            let mut command = Command::new(BIN);
            command.args(&args);
            let started = start(command, &format!("usbredir for {}", example.busid));
            let usbwire_testing::process::Started::Ready(running) = started else {
                return Err(format!("{args:?} did not start"));
            };
            running.stop();
        }
    }
    Ok(())
}

/// `bench -r … -b …` against a loopback device, a short matrix.
fn benches(example: &Example, loopback: &Server) -> Result<(), String> {
    let found = loopback.devices.iter().find(|(busid, _)| *busid == example.busid);
    if found.is_none_or(|(_, kind)| kind != "loopback") {
        return Err(format!("{} is not the loopback device of `serve --virtual loopback`", example.busid));
    }
    let mut args = loopback.aimed(example);
    args.extend(["--sizes", "4096", "--depths", "1", "--seconds", "0.2"].map(str::to_owned));
    let out = run(&args);
    if !out.status.success() {
        return Err(format!("{args:?}: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(())
}

/// What one example claims, checked; `Err` says what is wrong.
fn check(example: &Example, demo: &Server, loopback: &Server, dir: &Path) -> Result<(), String> {
    let kind = kind(example);
    if kind == Kind::Placeholder {
        return Ok(());
    }
    let bus = shape(&example.busid).ok_or_else(|| format!("{:?} is not a bus id", example.busid))?;
    match kind {
        Kind::RealDevice if bus == "0" => Err("a real device's bus id is not on bus 0, the virtual devices'".into()),
        Kind::RealDevice => Ok(()),
        Kind::Bench => benches(example, loopback),
        _ if !demo.has(&example.busid) => Err(format!("the demo exports {:?}, not {}", demo.devices, example.busid)),
        Kind::Runs => runs_against_the_demo(example, demo, dir),
        _ => Ok(()),
    }
}

#[test]
fn every_example_that_names_a_bus_id_works_against_the_demo() {
    let dir = scratch("help_examples", "demo");
    let texts = documentation(&dir.join("man"));
    let examples = collect(&texts);

    let mut demo = Command::new(BIN);
    demo.args(["demo", "--listen", &free_addr().to_string(), "--dir"])
        .arg(dir.join("files"))
        .arg("--control")
        .arg(dir.join("demo.sock"));
    // Its last line: by then its own describe and bench are done, and every device is free.
    let demo = Server::start(demo, "Disk image:");
    assert_eq!(demo.devices.len(), 3, "{:?}", demo.devices);
    let mut loopback = Command::new(BIN);
    loopback.args(["serve", "--no-advertise", "--virtual", "loopback", "--listen", &free_addr().to_string()]);
    loopback.arg("--control").arg(dir.join("loopback.sock"));
    let loopback = Server::start(loopback, "usbwire serving on");

    let mut wrong = Vec::new();
    for (example, sources) in &examples {
        if let Err(why) = check(example, &demo, &loopback, &dir) {
            wrong.push(format!("{} (in {}): {why}", example.line(), sources.join(", ")));
        }
    }
    assert!(wrong.is_empty(), "examples that do not do what they say:\n{}", wrong.join("\n"));

    // What was checked: every kind of source, and every kind of example.
    let from = |prefix: &str| examples.values().flatten().any(|source| source.starts_with(prefix));
    assert!(from("usbwire --help") && from("man page") && from("README.md"), "{examples:#?}");
    assert!(examples.values().flatten().any(|source| source == "usbwire demo --help"), "{examples:#?}");
    for wanted in [Kind::RealDevice, Kind::Kernel, Kind::Bench, Kind::Runs, Kind::Named] {
        assert!(examples.keys().any(|e| kind(e) == wanted), "no {wanted:?} example found: {examples:#?}");
    }
}
