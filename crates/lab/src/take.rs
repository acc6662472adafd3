//! Taking a device: [`Lab::reserve`].
//!
//! A reservation reads one short page of the free devices under the first of
//! its selector's indexed terms (`index/free/…`, see [`crate::entry`]), from
//! a random bucket so racing clients spread over the lab, and tries those
//! devices in random order, [`CHAIN`] at a time: each try is one transaction
//! that reserves the first of its devices that has no reservation and is
//! still free under every indexed term of the selector (so it matches all of
//! them), each device's test and reservation nested in the previous one's
//! failure branch (etcd ≥ 3.3). The transaction that takes a device deletes
//! its free keys under the selector's terms; its server deletes those of its
//! other terms once it sees the reservation (and writes them all again when
//! the reservation ends: `publish`). A page read from a member that is behind
//! may still show devices already taken: a chain still takes one of its
//! other devices in the same transaction.
//! Uncontended, a reservation reads [`FREE_PAGE`] keys, with one lease grant
//! at the same time, and runs one transaction, whatever the lab's size. When the free pages hold nothing it can take (a
//! selector of a bus id or a server alone, every matching device taken,
//! servers that do not publish free keys), it reads the index in full and the
//! lab's reservation keys at its revision (an index key says its device's
//! state, not whether it is reserved): that read also says why none is free.
//! Not for holding or giving back a reservation (`lab`).

use std::time::SystemTime;

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse, TxnResponse};
use rand::seq::SliceRandom as _;
use usbwire_proto::reservation::ReservationToken;
use usbwire_proto::retry::Retry;

use crate::entry::BUCKETS;
use crate::entry::{
    decode, timestamp, Availability, DeviceEntry, Key, ReservationEntry, ServerEntry, Want, SCHEMA_VERSION,
};
use crate::error::LabError;
use crate::etcd::keep_alive;
use crate::lab::{hex, holder_name, names_its_key, prefix_end, Hold, Lab, Reservation};
use crate::request::{self, permission_denied, transient, RETRY_WITHIN};

/// Free-device keys one page reads.
pub(crate) const FREE_PAGE: i64 = 32;
/// Buckets a page's first read spans, from a random one: etcd 3.4 walks its
/// index over a range's every key whatever the limit (3.5 stops at the
/// limit), so a read to the prefix's end would cost etcd O(matching devices).
/// 16 of 256 buckets hold 32 free keys once 512 devices are free.
const WINDOW: u32 = 16;
/// Pages read from random buckets before the full index is read (each tried
/// until two of its chains were lost to faster clients).
const FREE_PAGES: usize = 4;
/// Devices one transaction tries, in order (each nested in the failure
/// branch of the one before).
pub(crate) const CHAIN: usize = 8;

impl Lab {
    /// Takes a free device that matches `want` (see the module docs). Fails
    /// with [`LabError::NoMatch`] or [`LabError::NoneFree`].
    pub async fn reserve(&mut self, want: &Want, hold: Hold, client: &str) -> Result<Reservation, LabError> {
        let mut taking = Taking::new(hold, client);
        let taken = self.take(want, &mut taking).await;
        if let (Err(_), Some(lease)) = (&taken, taking.lease) {
            let _ = request::lease_revoke(&self.client, lease).await;
        }
        taken
    }

    async fn take(&mut self, want: &Want, taking: &mut Taking) -> Result<Reservation, LabError> {
        let free = want.free_prefixes(&self.keys);
        if let Some(first) = free.first() {
            for round in 0..FREE_PAGES {
                let page = if round == 0 && taking.lease.is_none() {
                    // The reservation's lease is granted while the first page is read.
                    let (client, ttl) = (self.client.clone(), taking.ttl_secs);
                    let granting = async move { request::lease_grant(&client, ttl).await };
                    let (page, lease) = tokio::join!(self.free_page(first, want, &free), granting);
                    taking.lease = Some(lease?);
                    page?
                } else {
                    self.free_page(first, want, &free).await?
                };
                if page.is_empty() {
                    break;
                }
                // A page is read from whichever member answers, and may be behind: after
                // two chains lost, it is likely stale where racing clients took from it.
                // A lost chain also says which others of the page are reserved.
                let mut lost = 0;
                let mut left = page;
                while !left.is_empty() && lost < 2 {
                    let rest = left.split_off(left.len().min(CHAIN));
                    match self.try_take(&left, &rest, taking).await? {
                        Tried::Taken(reservation) => return Ok(*reservation),
                        Tried::Skipped(at) => {
                            // The chain's devices after the skipped one were not tried.
                            left.drain(..=at);
                            left.extend(rest);
                        }
                        Tried::Lost(reserved) => {
                            lost += 1;
                            left = rest.into_iter().zip(reserved).filter(|(_, r)| !r).map(|(c, _)| c).collect();
                        }
                    }
                }
            }
        }
        self.take_from_the_index(want, taking).await
    }

    /// Up to [`FREE_PAGE`] devices free under `first` (from a random bucket
    /// on, [`WINDOW`] buckets first, wrapping to the prefix's start), that the bus id and server terms
    /// allow, in random order; each to be taken only while free under every
    /// prefix of `free`.
    async fn free_page(&mut self, first: &str, want: &Want, free: &[String]) -> Result<Vec<Candidate>, LabError> {
        let start = rand::random::<u32>() % BUCKETS;
        let window = start + WINDOW;
        // The window first; then, when it holds too few (a small lab, or most taken),
        // the rest of the prefix from its end on, wrapping to the prefix's start.
        let mut kvs = self.keys_in_buckets(first, start, window, FREE_PAGE).await?;
        let short = FREE_PAGE - i64::try_from(kvs.len()).unwrap_or(FREE_PAGE);
        if short > 0 {
            kvs.extend(self.keys_in_buckets(first, window, start + BUCKETS, short).await?);
        }
        let mut page: Vec<Candidate> = kvs
            .iter()
            .filter_map(|key| self.keys.parse_free_entry(first, key))
            .filter(|(server, busid)| want.matches_place(server, busid))
            .map(|(server, busid)| {
                let free_keys: Vec<String> =
                    free.iter().map(|prefix| self.keys.free_entry_under(prefix, &server, &busid)).collect();
                let conditions =
                    free_keys.iter().map(|key| Compare::create_revision(key.clone(), CompareOp::NotEqual, 0)).collect();
                Candidate { server, busid, conditions, free_keys, availability: Availability::AVAILABLE.to_owned() }
            })
            .collect();
        page.shuffle(&mut rand::thread_rng());
        Ok(page)
    }

    /// Up to `limit` keys of the free prefix `first` in the buckets
    /// `[from, to)`, counted on past the last bucket to wrap to the first
    /// (two ranges then).
    async fn keys_in_buckets(&mut self, first: &str, from: u32, to: u32, limit: i64) -> Result<Vec<Vec<u8>>, LabError> {
        let (from, to) = if from >= BUCKETS { (from - BUCKETS, to - BUCKETS) } else { (from, to) };
        let bucket = |b: u32| format!("{first}{b:02x}").into_bytes();
        let end = |b: u32| if b >= BUCKETS { prefix_end(first) } else { bucket(b) };
        let mut kvs = self.keys_between(bucket(from), end(to), limit).await?;
        let short = limit - i64::try_from(kvs.len()).unwrap_or(limit);
        if to > BUCKETS && short > 0 {
            kvs.extend(self.keys_between(bucket(0), end(to - BUCKETS), short).await?);
        }
        Ok(kvs)
    }

    /// Up to `limit` keys in `[from, to)`, without their values, as the
    /// member asked has applied them (serializable: it answers at once,
    /// where a linearizable read would wait for the leader and behind every
    /// write a busy lab commits). A page is only where to look: a device it
    /// still shows free after someone took it costs a transaction that finds
    /// its free key gone, and pages that show nothing lead to the full,
    /// linearizable read of the index.
    async fn keys_between(&mut self, from: Vec<u8>, to: Vec<u8>, limit: i64) -> Result<Vec<Vec<u8>>, LabError> {
        let options = GetOptions::new().with_range(to).with_limit(limit).with_keys_only().with_serializable();
        let mut response = request::get(&self.client, from, Some(options)).await?;
        self.reads.count(&response);
        Ok(response.take_kvs().into_iter().map(|kv| kv.key().to_vec()).collect())
    }

    /// The full read: every matching device from the index, tried in random
    /// order; after two lost to someone faster the index is read again rather
    /// than a stale list walked (racing clients find out at once when none is
    /// left). Bounded, in case devices keep changing.
    async fn take_from_the_index(&mut self, want: &Want, taking: &mut Taking) -> Result<Reservation, LabError> {
        let mut seen = Seen::of(self.candidates(want).await?);
        if seen.matching == 0 {
            return Err(LabError::NoMatch { want: want.to_string() });
        }
        let attempts = 2 * seen.matching + 8;
        let mut tried = 0;
        let mut lost_since_read = 0;
        while !seen.free.is_empty() {
            let mut chain = seen.free.split_off(seen.free.len().saturating_sub(CHAIN));
            tried += chain.len();
            if tried > attempts {
                break;
            }
            match self.try_take(&chain, &[], taking).await? {
                Tried::Taken(reservation) => return Ok(*reservation),
                Tried::Skipped(at) => {
                    chain.drain(..=at);
                    seen.free.extend(chain);
                }
                Tried::Lost(_) => {
                    lost_since_read += 1;
                    if lost_since_read >= 2 || seen.free.is_empty() {
                        lost_since_read = 0;
                        seen = Seen::of(self.candidates(want).await?);
                    }
                }
            }
        }
        Err(seen.none_free(want))
    }

    /// The devices `want` matches, with their availability: from the index
    /// of each term that has one (their intersection), else the device list.
    async fn candidates(&mut self, want: &Want) -> Result<Vec<Candidate>, LabError> {
        let prefixes = want.index_prefixes(&self.keys);
        if prefixes.is_empty() {
            // Only a bus id or a server: read the device entries themselves.
            let fleet = self.fleet().await?;
            return Ok(fleet
                .devices
                .iter()
                .filter(|d| want.matches(&d.device))
                .map(|d| {
                    let reserved = d.reservation.is_some();
                    let availability = Availability::of(d.device.state(), reserved).to_owned();
                    let index_key = self.keys.index_entry(
                        "id",
                        &format!("{}:{}", d.device.record.vendor_id, d.device.record.product_id),
                        &d.device.server,
                        &d.device.record.busid,
                    );
                    Candidate {
                        server: d.device.server.clone(),
                        busid: d.device.record.busid.clone(),
                        conditions: vec![still_available(index_key)],
                        free_keys: Vec::new(),
                        availability,
                    }
                })
                .collect());
        }
        let mut revision = None;
        let mut found: Option<Vec<Candidate>> = None;
        for prefix in &prefixes {
            let (at, kvs) = self.range(prefix, revision, false).await?;
            revision = Some(at);
            let here: Vec<Candidate> = kvs
                .iter()
                .filter_map(|kv| {
                    let (server, busid) = self.keys.parse_index_entry(prefix, kv.key())?;
                    want.matches_place(&server, &busid).then(|| Candidate {
                        server,
                        busid,
                        conditions: vec![still_available(String::from_utf8_lossy(kv.key()).into_owned())],
                        free_keys: Vec::new(),
                        availability: String::from_utf8_lossy(kv.value()).into_owned(),
                    })
                })
                .collect();
            found = Some(match found {
                None => here,
                Some(before) => before
                    .into_iter()
                    .filter(|c| here.iter().any(|h| h.server == c.server && h.busid == c.busid))
                    .collect(),
            });
        }
        let mut found = found.unwrap_or_default();
        if let (Some(revision), true) = (revision, found.iter().any(|c| c.availability == Availability::AVAILABLE)) {
            self.mark_reserved(&mut found, revision).await?;
        }
        Ok(found)
    }

    /// Marks the candidates that have a reservation at `revision` (the
    /// index's) as reserved: an index key says its device's state alone
    /// (older servers also wrote `reserved` there, which reads the same).
    /// Reads the reservations' keys, not their records.
    async fn mark_reserved(&mut self, candidates: &mut [Candidate], revision: i64) -> Result<(), LabError> {
        let [_, _, reservations] = self.keys.fleet_prefixes();
        let (_, kvs) = self.range(&reservations, Some(revision), true).await?;
        let reserved: std::collections::HashSet<(String, String)> = kvs
            .iter()
            .filter_map(|kv| match self.keys.parse(kv.key()) {
                Some(Key::Reservation { server, busid }) => Some((server, busid)),
                _ => None,
            })
            .collect();
        for candidate in candidates.iter_mut() {
            if candidate.availability == Availability::AVAILABLE
                && reserved.contains(&(candidate.server.clone(), candidate.busid.clone()))
            {
                Availability::RESERVED.clone_into(&mut candidate.availability);
            }
        }
        Ok(())
    }

    /// One transaction: the reservation of the first device of `chain` that
    /// has none and whose conditions hold, with its device and server entries
    /// read back; lost, it counts the reservations of `rest`.
    async fn try_take(
        &mut self,
        chain: &[Candidate],
        rest: &[Candidate],
        taking: &mut Taking,
    ) -> Result<Tried, LabError> {
        let lease = match taking.lease {
            Some(lease) => lease,
            None => *taking.lease.insert(request::lease_grant(&self.client, taking.ttl_secs).await?),
        };
        let Some((take, landed)) = self.chain_txns(chain, rest, taking, lease) else {
            return Ok(Tried::Lost(vec![false; rest.len()]));
        };
        self.reads.transactions += 1;
        let response = match self.take_once(take, landed.clone(), taking).await {
            Err(LabError::Request(error)) if self.takes_free_keys && permission_denied(&error) => {
                // A role that may write reservations but not the index (README): the
                // servers delete the free keys, as they do those of other terms.
                tracing::debug!(%error, "this registry user may not delete free-device keys; left to their servers");
                self.takes_free_keys = false;
                let Some((take, _)) = self.chain_txns(chain, rest, taking, lease) else {
                    return Ok(Tried::Lost(vec![false; rest.len()]));
                };
                self.reads.transactions += 1;
                self.take_once(take, landed, taking).await?
            }
            answered => answered?,
        };
        let (depth, answered) = branch_taken(response);
        let Some(candidate) = chain.get(depth) else {
            let reserved = answered.iter().map(|op| matches!(op, TxnOpResponse::Get(got) if got.count() > 0)).collect();
            return Ok(Tried::Lost(reserved));
        };
        let key = self.keys.reservation(&candidate.server, &candidate.busid);
        let mut read = answered.into_iter().filter_map(|op| match op {
            TxnOpResponse::Get(got) => got.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        });
        let device = read.next().and_then(|v| decode::<DeviceEntry>(&v));
        let server = read.next().and_then(|v| decode::<ServerEntry>(&v));
        let (Some(device), Some(server)) = (device, server) else {
            // Its server went between the read and now: give it back, try another.
            let _ = request::delete(&self.client, key, None).await;
            return Ok(Tried::Skipped(depth));
        };
        if !names_its_key(&server, &device, &candidate.server, &candidate.busid) {
            // Records under one server's keys that name another: a client would
            // import from (and pin the key of) a server other than the one reserved.
            tracing::warn!(server = %candidate.server, busid = %candidate.busid, named_server = %server.address,
                named_device = %format!("{} {}", device.server, device.record.busid),
                "skipped: its registry records name another server or device than their keys");
            let _ = request::delete(&self.client, key, None).await;
            return Ok(Tried::Skipped(depth));
        }
        if taking.answers_lost {
            self.give_back_all_but(lease, &key).await?;
        }
        let renewing = matches!(taking.hold, Hold::WhileRunning { .. })
            .then(|| tokio::spawn(keep_alive(self.endpoint.clone(), self.client.clone(), lease, taking.ttl)));
        tracing::debug!(server = %device.server, busid = %device.record.busid, lease = format_args!("{lease:x}"), "reserved");
        // Taken: the lease is the reservation's now.
        taking.lease = None;
        Ok(Tried::Taken(Box::new(Reservation {
            server,
            device,
            entry: taking.entry.clone(),
            token: taking.token,
            lease,
            client: self.client.clone(),
            renewing,
        })))
    }

    /// A chain's transaction, and the question whether it landed: the
    /// reservation of the first device of `chain` that has none and whose
    /// conditions hold (with its free keys under the selector's terms
    /// deleted, if this user may), its device and server entries read back;
    /// lost, the reservations of `rest` counted. `None` for an empty chain.
    fn chain_txns(&self, chain: &[Candidate], rest: &[Candidate], taking: &Taking, lease: i64) -> Option<(Txn, Txn)> {
        let reads = |candidate: &Candidate| {
            [
                TxnOp::get(self.keys.device(&candidate.server, &candidate.busid), None),
                TxnOp::get(self.keys.server(&candidate.server), None),
            ]
        };
        // Lost, it tells which of `rest` are reserved by then (count only: nothing else is read).
        let who_else: Vec<TxnOp> = rest
            .iter()
            .map(|other| {
                let key = self.keys.reservation(&other.server, &other.busid);
                TxnOp::get(key, Some(GetOptions::new().with_count_only()))
            })
            .collect();
        // Built from the chain's last device on: each in the failure branch of the one before.
        let (mut take, mut landed): (Option<Txn>, Option<Txn>) = (None, None);
        for candidate in chain.iter().rev() {
            let key = self.keys.reservation(&candidate.server, &candidate.busid);
            let mut conditions = vec![Compare::create_revision(key.clone(), CompareOp::Equal, 0)];
            conditions.extend(candidate.conditions.iter().cloned());
            let put = TxnOp::put(key.clone(), taking.json.clone(), Some(PutOptions::new().with_lease(lease)));
            let otherwise = take.take().map_or_else(|| who_else.clone(), |inner| vec![TxnOp::txn(inner)]);
            // Its free keys under the selector's terms go with it: racing clients' pages
            // no longer show it (its server deletes the rest when it sees the reservation).
            let free_keys = if self.takes_free_keys { candidate.free_keys.as_slice() } else { &[] };
            let taken = free_keys.iter().map(|free| TxnOp::delete(free.clone(), None));
            let then: Vec<TxnOp> = std::iter::once(put).chain(taken).chain(reads(candidate)).collect();
            take = Some(Txn::new().when(conditions).and_then(then).or_else(otherwise));
            // If a try's answer is lost, the reservation may be ours already.
            let ours = Compare::value(key, CompareOp::Equal, taking.json.clone());
            let otherwise = landed.take().map(|inner| vec![TxnOp::txn(inner)]).unwrap_or_default();
            landed = Some(Txn::new().when([ours]).and_then(reads(candidate)).or_else(otherwise));
        }
        take.zip(landed)
    }

    /// Runs `take` (a reservation's transaction) once; when its answer is
    /// lost to a transient failure, asks with `landed` whether it took
    /// effect on any device of its chain (the reservation is ours: its record
    /// is unique to this try's token) before running it again, with the
    /// client's retry waits, for at most [`RETRY_WITHIN`]. Never two
    /// reservations from one try.
    async fn take_once(&mut self, take: Txn, landed: Txn, taking: &mut Taking) -> Result<TxnResponse, LabError> {
        let started = tokio::time::Instant::now();
        let mut backoff = Retry::PATIENT.backoff();
        backoff.next_delay();
        let mut last = self.client.txn(take.clone()).await;
        loop {
            let error = match last {
                Err(error) if transient(&error) && started.elapsed() + backoff.upcoming() < RETRY_WITHIN => error,
                outcome => return Ok(outcome?),
            };
            tracing::debug!(%error, "a reservation's answer was lost; asking whether it landed");
            taking.answers_lost = true;
            tokio::time::sleep(backoff.next_delay()).await;
            let ours = request::txn(&self.client, landed.clone()).await?;
            if branch_taken(ours.clone()).0 != usize::MAX {
                return Ok(ours);
            }
            last = self.client.txn(take.clone()).await;
        }
    }

    /// Deletes every key under `lease` but `kept`: a reservation whose
    /// answer was lost and that landed after it was asked about (then
    /// counted as lost to someone else) would otherwise hold its device for
    /// as long as the lease lives.
    async fn give_back_all_but(&mut self, lease: i64, kept: &str) -> Result<(), LabError> {
        let options = etcd_client::LeaseTimeToLiveOptions::new().with_keys();
        let attached = request::retried("lease keys", || {
            let mut client = self.client.clone();
            let options = options.clone();
            async move { client.lease_time_to_live(lease, Some(options)).await }
        })
        .await?;
        for key in attached.keys().iter().filter(|key| key.as_slice() != kept.as_bytes()) {
            tracing::debug!(key = %String::from_utf8_lossy(key), "gave back a reservation whose answer was lost");
            request::delete(&self.client, key.clone(), None).await?;
        }
        Ok(())
    }
}

/// A reservation being taken: its record, and its lease once granted (revoked
/// if none is taken).
struct Taking {
    hold: Hold,
    ttl: std::time::Duration,
    ttl_secs: i64,
    token: ReservationToken,
    entry: ReservationEntry,
    json: String,
    lease: Option<i64>,
    /// Whether a try's answer was lost: it may have landed after it was
    /// asked about, and hold a device under the lease besides the one taken.
    answers_lost: bool,
}

impl Taking {
    fn new(hold: Hold, client: &str) -> Self {
        let (ttl, until) = match hold {
            Hold::WhileRunning { ttl, until } => (ttl, until),
            Hold::For(duration) => (duration, Some(SystemTime::now() + duration)),
        };
        let token = ReservationToken(rand::random());
        let entry = ReservationEntry {
            schema_version: SCHEMA_VERSION,
            holder: holder_name(),
            client: client.to_owned(),
            pid: std::process::id(),
            token_sha256: hex(&usbwire_server::reservation::digest(&token)),
            since_at: timestamp(SystemTime::now()),
            until_at: until.map(timestamp),
        };
        let json = serde_json::to_string(&entry).unwrap_or_default();
        let ttl_secs = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        Self { hold, ttl, ttl_secs, token, entry, json, lease: None, answers_lost: false }
    }
}

/// Which device of a chain's transaction (or of its "landed" question) took
/// its success branch, counted from 0 down the nested failure branches, and
/// that branch's answers; `usize::MAX` when none did, with the innermost
/// failure branch's answers.
fn branch_taken(response: TxnResponse) -> (usize, Vec<TxnOpResponse>) {
    let mut depth = 0;
    let mut response = response;
    loop {
        let mut answers = response.op_responses();
        if response.succeeded() {
            return (depth, answers);
        }
        match answers.pop() {
            Some(TxnOpResponse::Txn(inner)) if answers.is_empty() => {
                depth += 1;
                response = inner;
            }
            last => {
                answers.extend(last);
                return (usize::MAX, answers);
            }
        }
    }
}

/// The condition of a device found in the index: its entry there still says available.
fn still_available(index_key: String) -> Compare {
    Compare::value(index_key, CompareOp::Equal, Availability::AVAILABLE)
}

/// What one try came to.
enum Tried {
    Taken(Box<Reservation>),
    /// Someone was faster on every device of the chain (or they are no
    /// longer free); for each of the other candidates the try was given,
    /// whether it was reserved then.
    Lost(Vec<bool>),
    /// The chain's device at this place was taken, but its records were
    /// gone or named another server: given back (the devices after it in
    /// the chain were not tried).
    Skipped(usize),
}

/// What one read of the index showed: the free candidates (shuffled, so
/// racing clients spread out) and the counts an error reports.
struct Seen {
    free: Vec<Candidate>,
    matching: usize,
    reserved: usize,
    in_use: usize,
}

impl Seen {
    fn of(candidates: Vec<Candidate>) -> Self {
        let matching = candidates.len();
        let reserved = candidates.iter().filter(|c| c.availability == Availability::RESERVED).count();
        let mut free: Vec<Candidate> =
            candidates.into_iter().filter(|c| c.availability == Availability::AVAILABLE).collect();
        free.shuffle(&mut rand::thread_rng());
        let in_use = matching - reserved - free.len();
        Self { free, matching, reserved, in_use }
    }

    fn none_free(&self, want: &Want) -> LabError {
        LabError::NoneFree {
            want: want.to_string(),
            matching: self.matching,
            reserved: self.reserved + self.free.len(),
            in_use: self.in_use,
        }
    }
}

/// A device a selector matches.
pub(crate) struct Candidate {
    pub(crate) server: String,
    pub(crate) busid: String,
    /// What the reservation's transaction checks besides the reservation's absence.
    pub(crate) conditions: Vec<Compare>,
    /// Its free keys that the reservation's transaction deletes: those under
    /// the selector's terms, when it was found in their pages.
    pub(crate) free_keys: Vec<String>,
    /// Its availability word when it was read.
    pub(crate) availability: String,
}

#[cfg(test)]
mod tests;
