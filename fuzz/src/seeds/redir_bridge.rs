//! Seeds of the redir_bridge harness (`src/redir_bridge.rs`): a QEMU-like guest
//! against the bridge, with every transfer type, tight budgets, either side
//! going away, and a device that re-enumerates under a bridge that follows it.

// size-exempt: a table of seed inputs, one per scenario.
/// redir_bridge: `[caps, budget, flags] ++ ops` (see `src/redir_bridge.rs`): a
/// QEMU-like guest using every transfer type against a server answering all,
/// and the same guest flooding a tight budget, cancelling, going silent or
/// away, against a server that answers as the ops say.
pub(super) fn redir_bridge_seeds(add: &mut impl FnMut(&'static str, &str, &[u8], Vec<u8>)) {
    // Ops: [1, kind, id, endpoint, fields…] a guest packet; [2, pick, how] a server
    // answer; [4, n] the guest reads n * 64 bytes (0: all); [5, n] n * 50 ms pass;
    // [6] the server goes; [7] the guest hangs up; [8, 1] the server stops reading.
    let control_in = |id: u8, request: u8, value: u16, length: u16| {
        let [v0, v1] = value.to_le_bytes();
        let [l0, l1] = length.to_le_bytes();
        vec![1, 0, id, 0, request, 0x80, v0, v1, 0, 0, l0, l1]
    };
    let bulk = |id: u8, endpoint: u8, length: u16| {
        let [l0, l1] = length.to_le_bytes();
        vec![1, 1, id, endpoint, l0, l1, 0]
    };
    let set_configuration = vec![1, 9, 1, 1];
    let transfers: Vec<Vec<u8>> = vec![
        set_configuration.clone(),
        control_in(2, 6, 0x0100, 18),
        bulk(3, 0x02, 31),
        bulk(4, 0x82, 512),
        vec![1, 2, 5, 0x81, 8, 0],  // interrupt IN
        vec![1, 4, 6, 0x81],        // start interrupt receiving
        vec![1, 11, 7, 2, 1],       // alt setting 1 of interface 2 (iso endpoints)
        vec![1, 6, 8, 0x83, 4, 2],  // start iso IN: 4 packets per URB, 2 URBs
        vec![1, 6, 9, 0x03, 2, 2],  // start iso OUT
        vec![1, 3, 10, 0x03, 3, 0], // an iso OUT packet
        vec![1, 3, 11, 0x03, 0, 0], // and an empty one
        vec![1, 7, 12, 0x83],       // stop iso IN
        vec![1, 5, 13, 0x81],       // stop interrupt receiving
        vec![1, 12, 14, 2],         // get alt setting
        vec![1, 13, 15, 0],         // reset
    ];
    // 16 URBs, 64 KiB in flight, 64 KiB for the guest; reads of 64 KiB; the guest reads
    // and the server answers everything after each op.
    let (budget, flags) = (3 | 2 << 2 | 2 << 4, 5 << 1 | 0x20 | 0x40);
    add("redir_bridge", "every_transfer_type", &[0xfe, budget, flags], transfers.concat());
    add("redir_bridge", "every_transfer_type_no_caps", &[0, budget, flags | 1], transfers.concat());

    // One URB, 512 bytes in flight, 256 for the guest, 7-byte reads, a guest that
    // does not read and a server that answers only when told: the bridge must stop.
    let mut flood = vec![set_configuration.clone(), vec![2, 0, 3]];
    for id in 20..40 {
        flood.push(bulk(id, 0x82, 4096));
        flood.push(bulk(id + 40, 0x02, 600));
    }
    flood.extend([vec![2, 0, 0], vec![2, 0, 1], vec![4, 2], vec![2, 0, 0], vec![4, 0], vec![2, 0, 4]]);
    add("redir_bridge", "flood_tight_budget", &[0xfe, 0, 1 << 1], flood.concat());

    // Cancels: a bulk IN cancelled, answered the kernel's way then usbwire's way.
    let cancels = [
        set_configuration.clone(),
        vec![2, 0, 3],
        bulk(50, 0x82, 512),
        vec![1, 8, 50, 0],
        vec![2, 1, 0],
        bulk(51, 0x82, 512),
        vec![1, 8, 51, 0],
        vec![2, 1, 1],
        vec![2, 0, 0],
        vec![4, 0],
    ];
    add("redir_bridge", "cancels", &[0xfe, 3 | 1 << 2 | 1 << 4, 4 << 1], cancels.concat());

    // Keep-alive: a URB the server never answers, then silence past the bound.
    let silent = [set_configuration.clone(), vec![2, 0, 3], bulk(60, 0x82, 64), vec![5, 20], vec![5, 60], vec![4, 0]];
    add("redir_bridge", "server_goes_silent", &[0xfe, 3 | 2 << 2 | 2 << 4, 1 | 3 << 1], silent.concat());

    // The server stops reading, then goes away; the guest hangs up with bytes unread.
    let gone = [
        set_configuration.clone(),
        vec![2, 0, 3],
        vec![8, 1],
        bulk(70, 0x02, 4000),
        bulk(71, 0x02, 4000),
        vec![5, 30],
        vec![6],
        vec![5, 30],
        vec![4, 0],
    ];
    add("redir_bridge", "server_stops_reading_then_goes", &[0xfe, 1 | 1 << 2, 3 << 1], gone.concat());
    let hang_up = [bulk(80, 0x82, 512), bulk(81, 0x82, 512), vec![7]];
    add("redir_bridge", "guest_hangs_up_while_full", &[0xfe, 0, 2 << 1 | 0x40], hang_up.concat());

    // Regression: a guest's bulk IN of 128 MiB, past what a USB/IP server takes
    // (16 MiB), once made the server close the connection and the guest lose the
    // device; the bridge now fails that request alone, and the next one works.
    let too_long = [set_configuration.clone(), vec![2, 0, 3], vec![1, 1, 90, 0x82, 0xff, 0xff, 11], bulk(91, 0x82, 64)];
    add(
        "redir_bridge",
        "regression_transfer_past_usbip_limit",
        &[0xfe, 3 | 2 << 2 | 2 << 4, 5 << 1 | 0x60],
        too_long.concat(),
    );

    // Both isochronous streams started with 253 URBs of 251 packets each at once: one
    // read's URBs far past a 1 MiB budget (their data waits; what they hold is bounded).
    let big_streams = [
        set_configuration.clone(),
        vec![1, 11, 7, 2, 1],
        vec![1, 6, 8, 0x83, 251, 253],
        vec![1, 6, 9, 0x03, 251, 253],
        vec![1, 3, 10, 0x03, 0xc0, 0],
    ];
    add(
        "redir_bridge",
        "iso_streams_past_the_budget",
        &[0, 3 | 3 << 2 | 2 << 4, 1 | 5 << 1 | 0x60],
        big_streams.concat(),
    );

    // Enumeration by hand (the descriptor reads answered by the ops), then a filter
    // that refuses HID interfaces.
    let manual =
        [vec![2, 0, 3], vec![2, 0, 3], vec![2, 0, 3], vec![2, 0, 3], vec![4, 0], vec![1, 14, 0, 1], vec![4, 0]];
    add("redir_bridge", "manual_enumeration_filtered", &[0xfe, 3 | 3 << 2 | 3 << 4, 0x10 | 5 << 1], manual.concat());

    // A bridge that follows (flags bit 7; ops [9] the device re-enumerates, [10] it is
    // imported again): interrupt receiving and a bulk IN in flight when the device goes,
    // the guest's ack of the disconnect, the new device used, then gone and back again
    // before the guest acknowledged. A resumable server says END(REENUMERATED), a stock
    // one closes.
    let ack = vec![1, 16, 0, 0];
    let follow = [
        set_configuration.clone(),
        vec![2, 0, 3],
        vec![1, 4, 6, 0x81],
        bulk(3, 0x82, 512),
        vec![2, 0, 0],
        vec![9],
        vec![4, 0],
        ack.clone(),
        vec![10],
        vec![4, 0],
        set_configuration.clone(),
        vec![2, 0, 3],
        bulk(4, 0x02, 64),
        vec![9],
        vec![10],
        ack,
        vec![4, 0],
        bulk(5, 0x82, 64),
        vec![2, 0, 0],
        vec![4, 0],
    ];
    let budget = 2 | 2 << 2 | 2 << 4;
    add("redir_bridge", "follows_reenumerations_resumable", &[0xfe, budget, 0x80 | 1 | 3 << 1], follow.concat());
    add("redir_bridge", "follows_reenumerations_stock", &[0xfe, budget, 0x80 | 3 << 1], follow.concat());

    // The device re-enumerates on the guest's reset ([1, 13] a reset once configured):
    // the guest's descriptor read after it waits for the new device, which answers it.
    let reset = [
        set_configuration.clone(),
        vec![2, 0, 3],
        vec![4, 0],
        vec![1, 13, 0, 0],
        vec![9],
        control_in(7, 6, 0x0100, 64),
        vec![4, 0],
        vec![10],
        vec![2, 0, 3],
        vec![2, 0, 3],
        vec![2, 0, 3],
        vec![2, 0, 3],
        vec![2, 0, 3],
        vec![4, 0],
    ];
    add("redir_bridge", "reenumerates_on_the_guests_reset", &[0xfe, budget, 0x80 | 1 | 3 << 1], reset.concat());
}
