//! Setting the guest's wall clock from its RTC.
//!
//! A kernel with a built-in RTC driver and `CONFIG_RTC_HCTOSYS` sets the
//! clock itself while booting; then there is nothing to do. When the clock
//! is still implausibly early (before [`PLAUSIBLE_EPOCH`]) the agent reads
//! `/dev/rtc0` (`RTC_RD_TIME`, taken as UTC, which is what QEMU and our VMM
//! provide) and sets `CLOCK_REALTIME` from it. Without an RTC the clock is
//! left alone.
//!
//! Limits: no NTP; an RTC that keeps local time gives a skewed clock.

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use crate::sys;

/// The RTC device.
pub const RTC_DEVICE: &str = "/dev/rtc0";

/// A clock earlier than this (2024-01-01T00:00:00Z) was never set.
pub const PLAUSIBLE_EPOCH: i64 = 1_704_067_200;

/// `RTC_RD_TIME`: `_IOR('p', 0x09, struct rtc_time)`.
const RTC_RD_TIME: libc::c_ulong = 0x8024_7009;

/// Errors of setting the clock.
#[derive(Debug, thiserror::Error)]
pub enum ClockError {
    #[error("cannot read the RTC {path}: {source}")]
    Read { path: String, source: io::Error },
    #[error("the RTC reports an impossible time {0:?}")]
    Invalid(RtcTime),
    #[error("cannot set the clock: {0}")]
    Set(io::Error),
}

/// The kernel's `struct rtc_time` (fields as in `<linux/rtc.h>`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RtcTime {
    pub tm_sec: libc::c_int,
    pub tm_min: libc::c_int,
    pub tm_hour: libc::c_int,
    pub tm_mday: libc::c_int,
    /// 0-based month.
    pub tm_mon: libc::c_int,
    /// Years since 1900.
    pub tm_year: libc::c_int,
    pub tm_wday: libc::c_int,
    pub tm_yday: libc::c_int,
    pub tm_isdst: libc::c_int,
}

/// Days since 1970-01-01 of a proleptic Gregorian date (month 1..=12).
pub fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Seconds since the Unix epoch of an RTC reading taken as UTC, or `None`
/// when a field is out of range.
pub fn rtc_to_unix(t: &RtcTime) -> Option<i64> {
    let ok = (0..=60).contains(&t.tm_sec)
        && (0..=59).contains(&t.tm_min)
        && (0..=23).contains(&t.tm_hour)
        && (1..=31).contains(&t.tm_mday)
        && (0..=11).contains(&t.tm_mon)
        && (0..=1100).contains(&t.tm_year);
    if !ok {
        return None;
    }
    let days = days_from_civil(
        1900 + i64::from(t.tm_year),
        i64::from(t.tm_mon) + 1,
        i64::from(t.tm_mday),
    );
    Some(
        days * 86_400
            + i64::from(t.tm_hour) * 3600
            + i64::from(t.tm_min) * 60
            + i64::from(t.tm_sec),
    )
}

/// What [`sync_from_rtc`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum ClockOutcome {
    /// The clock was already plausible (the kernel set it).
    AlreadySet(i64),
    /// There is no RTC device.
    NoRtc,
    /// The clock was set to this many seconds since the epoch.
    Set(i64),
}

fn realtime_now() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec
}

fn read_rtc(path: &Path) -> Result<RtcTime, ClockError> {
    let read = |source| ClockError::Read {
        path: path.display().to_string(),
        source,
    };
    let dev = sys::open(path, libc::O_RDONLY | libc::O_CLOEXEC).map_err(read)?;
    let mut t = RtcTime::default();
    // SAFETY: RTC_RD_TIME fills a struct rtc_time, which `t` is.
    let r = unsafe { libc::ioctl(dev.as_raw_fd(), RTC_RD_TIME, &mut t as *mut RtcTime) };
    if r < 0 {
        return Err(read(io::Error::last_os_error()));
    }
    Ok(t)
}

/// Sets the clock from the RTC when it is not plausible yet.
pub fn sync_from_rtc() -> Result<ClockOutcome, ClockError> {
    let now = realtime_now();
    if now >= PLAUSIBLE_EPOCH {
        return Ok(ClockOutcome::AlreadySet(now));
    }
    let rtc = Path::new(RTC_DEVICE);
    if !rtc.exists() {
        return Ok(ClockOutcome::NoRtc);
    }
    let t = read_rtc(rtc)?;
    let secs = rtc_to_unix(&t).ok_or(ClockError::Invalid(t))?;
    let ts = libc::timespec {
        tv_sec: secs,
        tv_nsec: 0,
    };
    // SAFETY: valid timespec.
    sys::cvt(unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) }).map_err(ClockError::Set)?;
    Ok(ClockOutcome::Set(secs))
}

/// Runs [`sync_from_rtc`] and logs the outcome.
pub fn set_clock() {
    match sync_from_rtc() {
        Ok(ClockOutcome::AlreadySet(t)) => tracing::debug!(unix_time = t, "clock already set"),
        Ok(ClockOutcome::NoRtc) => tracing::info!("no RTC; clock left as is"),
        Ok(ClockOutcome::Set(t)) => tracing::info!(unix_time = t, "clock set from the RTC"),
        Err(e) => tracing::warn!(error = %e, "clock not set"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rtc(y: i32, mon: i32, d: i32, h: i32, mi: i32, s: i32) -> RtcTime {
        RtcTime {
            tm_year: y - 1900,
            tm_mon: mon - 1,
            tm_mday: d,
            tm_hour: h,
            tm_min: mi,
            tm_sec: s,
            ..RtcTime::default()
        }
    }

    #[test]
    fn civil_dates_to_unix_seconds() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(1969, 12, 31), -1);
        assert_eq!(
            rtc_to_unix(&rtc(2024, 1, 1, 0, 0, 0)),
            Some(PLAUSIBLE_EPOCH)
        );
        // A leap day and a time of day.
        assert_eq!(
            rtc_to_unix(&rtc(2024, 2, 29, 12, 34, 56)),
            Some(1_709_210_096)
        );
        assert_eq!(rtc_to_unix(&rtc(2038, 1, 19, 3, 14, 8)), Some(1 << 31));
    }

    #[test]
    fn out_of_range_fields_are_refused() {
        assert_eq!(rtc_to_unix(&rtc(2024, 13, 1, 0, 0, 0)), None);
        assert_eq!(rtc_to_unix(&rtc(2024, 1, 0, 0, 0, 0)), None);
        assert_eq!(rtc_to_unix(&rtc(2024, 1, 1, 24, 0, 0)), None);
        assert_eq!(rtc_to_unix(&rtc(1800, 1, 1, 0, 0, 0)), None);
    }

    #[test]
    fn matches_the_host_clock_conversion() {
        // Cross-check against libc's timegm for a spread of dates.
        for (y, mo, d) in [(1999, 12, 31), (2025, 7, 4), (2100, 2, 28), (2400, 2, 29)] {
            // SAFETY: tm is plain data.
            let mut tm: libc::tm = unsafe { std::mem::zeroed() };
            tm.tm_year = y - 1900;
            tm.tm_mon = mo - 1;
            tm.tm_mday = d;
            tm.tm_hour = 5;
            // SAFETY: valid tm.
            let expect = unsafe { libc::timegm(&mut tm) };
            assert_eq!(
                rtc_to_unix(&rtc(y, mo, d, 5, 0, 0)),
                Some(expect),
                "{y}-{mo}-{d}"
            );
        }
    }
}
