#!/bin/bash
grep apple data.txt > answer.txt
